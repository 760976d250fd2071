"""Integrations with other trainers, imported only when used (``import fp4lab`` never
imports them): MaxText (``python -m fp4lab.integrations.maxtext``)."""
