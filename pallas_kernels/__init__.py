"""Pallas GPU kernels for fp4lab's hot paths.

Each kernel module will hold the kernel, its wrapper and a pointer to the fp4lab reference it
must equal bit for bit; tests run the kernels in interpret mode on CPU.
"""
