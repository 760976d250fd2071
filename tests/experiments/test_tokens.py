"""Token files (experiments.data.load_tokens, data.tokens) and experiments.tokenize."""

import json
import pickle

import numpy as np
import pytest

from experiments import data as data_module
from experiments.configs import load_config
from experiments.data import (TextData, TokenData, default_val_path, load_data, load_text,
                              load_tokens, split_documents)

U16, U32 = 20240520, 20240801


def write_nanogpt(path, tokens):
    np.asarray(tokens, "<u2").tofile(path)
    return path


def write_llmc(path, tokens, magic=U16, version=None, count=None):
    header = np.zeros(256, "<i4")
    version = version or (1 if magic == U16 else 7)
    header[:3] = magic, version, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, "<u2" if magic == U16 else "<u4").tobytes())
    return path


def pair(folder, tokens, val, fmt="llmc", **kw):
    """``train.bin`` / ``val.bin`` in ``folder`` in format ``fmt``."""
    folder.mkdir(parents=True, exist_ok=True)
    write = write_llmc if fmt == "llmc" else write_nanogpt
    write(folder / "val.bin", val, **kw)
    return write(folder / "train.bin", tokens, **kw)


@pytest.fixture
def tokens():
    rng = np.random.default_rng(0)
    return rng.integers(0, 1000, 5000), rng.integers(0, 1000, 700)


def test_both_formats_read_back_the_tokens_written(tmp_path, tokens):
    train, val = tokens
    nano = load_tokens(pair(tmp_path / "n", train, val, "nanogpt"))
    llmc = load_tokens(pair(tmp_path / "l", train, val, "llmc"))
    assert (nano.token_format, llmc.token_format) == ("nanogpt", "llmc")
    np.testing.assert_array_equal(nano.train, np.fromfile(tmp_path / "n" / "train.bin", "<u2"))
    np.testing.assert_array_equal(llmc.train, np.fromfile(tmp_path / "l" / "train.bin", "<u2",
                                                          offset=1024))
    np.testing.assert_array_equal(llmc.val, val)
    assert isinstance(llmc.train, np.memmap) and isinstance(nano.val, np.memmap)
    wide = np.random.default_rng(1).integers(0, 200_000, 3000)  # LLaMA-3 sized ids
    d = load_tokens(pair(tmp_path / "w", wide, wide[:500], magic=U32))
    assert d.train.dtype == np.dtype("<u4") and d.vocab_size == int(wide.max()) + 1
    np.testing.assert_array_equal(d.train, np.fromfile(tmp_path / "w" / "train.bin", "<u4",
                                                       offset=1024))
    for fmt in ("nanogpt", "llmc"):  # an explicit format reads the same
        f = tmp_path / fmt[0] / "train.bin"
        np.testing.assert_array_equal(load_tokens(f, token_format=fmt).train, train)


def test_batches_are_a_pure_function_of_seed_and_step_and_equal_across_formats(tmp_path,
                                                                               tokens):
    train, val = tokens
    nano = load_tokens(pair(tmp_path / "n", train, val, "nanogpt"), seq_len=32)
    llmc = load_tokens(pair(tmp_path / "l", train, val, "llmc"), seq_len=32)
    again = load_tokens(tmp_path / "l" / "train.bin", seq_len=32)
    b = llmc.batch(3, 7, 8, 32)
    assert b.tokens.shape == (8, 33) and b.tokens.dtype == np.int32
    assert type(b.tokens) is np.ndarray and b.weights.shape == (8, 32)
    for other in (nano, again):
        np.testing.assert_array_equal(other.batch(3, 7, 8, 32).tokens, b.tokens)
        for x, y in zip(other.val_batches(2, 8, 32), llmc.val_batches(2, 8, 32), strict=True):
            np.testing.assert_array_equal(x.tokens, y.tokens)
    assert not np.array_equal(llmc.batch(3, 8, 8, 32).tokens, b.tokens)
    assert not np.array_equal(llmc.batch(4, 7, 8, 32).tokens, b.tokens)
    # the same windows as the byte data draws from the same array
    as_bytes = TextData(np.asarray(train), np.asarray(val), (1, 1), "x")
    np.testing.assert_array_equal(as_bytes.batch(3, 7, 8, 32).tokens, b.tokens)


def test_the_validation_file_is_found_beside_the_train_file(tmp_path, tokens):
    assert default_val_path("d/train.bin").as_posix() == "d/val.bin"
    assert default_val_path("d/tiny_shakespeare_train.bin").name == "tiny_shakespeare_val.bin"
    assert default_val_path("train/fw_train_0001.bin").as_posix() == "train/fw_val_0001.bin"
    with pytest.raises(ValueError, match=r"no 'train'.*set data.val_tokens"):
        default_val_path("d/tokens.bin")
    train, val = tokens
    write_llmc(tmp_path / "a_train.bin", train)
    with pytest.raises(FileNotFoundError, match=r"a_val.bin.*set data.val_tokens"):
        load_tokens(tmp_path / "a_train.bin")
    write_llmc(tmp_path / "held_out.bin", val)
    d = load_tokens(tmp_path / "a_train.bin", val_path=tmp_path / "held_out.bin")
    np.testing.assert_array_equal(d.val, val)
    with pytest.raises(FileNotFoundError, match="nothere.bin"):
        load_tokens(tmp_path / "nothere.bin")


def _bad_cases(tmp_path, train, val):
    """``(what to load, error match)`` for every kind of bad file."""
    t = tmp_path
    write_nanogpt(t / "val.bin", val)
    (t / "odd_train.bin").write_bytes(b"\1\0\2\0\3")
    write_nanogpt(t / "odd_val.bin", val)
    write_llmc(t / "magic_train.bin", train, magic=12345)
    write_llmc(t / "trunc_train.bin", train, count=len(train) + 10)
    write_llmc(t / "long_train.bin", train, count=len(train) - 10)
    write_llmc(t / "version_train.bin", train, version=3)
    (t / "head_train.bin").write_bytes(np.array([U16, 1, 5], "<i4").tobytes())
    write_llmc(t / "short_train.bin", train[:20])
    write_llmc(t / "ok_train.bin", train)
    write_llmc(t / "ok_val.bin", val)
    return [
        (dict(path=t / "odd_train.bin"), r"odd_train.bin: 5 bytes is an odd length"),
        (dict(path=t / "magic_train.bin", token_format="llmc"),
         r"magic_train.bin: header magic 12345 is not an llm.c"),
        (dict(path=t / "trunc_train.bin", val_path=t / "ok_val.bin"),
         r"trunc_train.bin: truncated: its header says 5,010 tokens"),
        (dict(path=t / "long_train.bin", val_path=t / "ok_val.bin"),
         r"long_train.bin: 20 bytes after the 4,990 tokens"),
        (dict(path=t / "version_train.bin", val_path=t / "ok_val.bin"),
         r"version_train.bin: llm.c header version 3 with magic 20240520"),
        (dict(path=t / "head_train.bin", token_format="llmc"),
         r"head_train.bin: 12 bytes is shorter than an llm.c header"),
        (dict(path=t / "short_train.bin", val_path=t / "ok_val.bin", seq_len=32),
         r"short_train.bin holds 20 tokens: too few for one sequence \(data.seq_len=32"),
        (dict(path=t / "ok_train.bin", seq_len=32, token_format="megatron"),
         r"data.token_format='megatron'"),
        (dict(path=t / "ok_train.bin", val_path=t / "val.bin"),
         r"ok_train.bin \(llmc, uint16\) and .*val.bin \(nanogpt, uint16\) are not in the same"),
        (dict(path=t / "ok_train.bin", vocab_size=-3), r"data.vocab_size=-3 must be >= 0"),
    ]


def test_bad_files_fail_clearly_naming_the_file_and_value(tmp_path, tokens):
    for kw, match in _bad_cases(tmp_path, *tokens):
        with pytest.raises(ValueError, match=match):
            load_tokens(kw.pop("path"), **kw)


def test_token_ids_beyond_the_vocabulary_fail_when_a_batch_holds_them(tmp_path):
    train = np.arange(5000) % 50
    train[1234] = 77
    d = load_tokens(pair(tmp_path, train, np.arange(600) % 50), vocab_size=50)
    with pytest.raises(ValueError, match=r"train.bin: token id 77 \(token 1,234 of the file\) "
                                         r"is not below the vocabulary size 50"):
        for step in range(1000):  # (checked per batch: some batch holds token 1234)
            d.batch(0, step, 8, 32)
    write_llmc(tmp_path / "val.bin", np.arange(600) % 60)
    with pytest.raises(ValueError, match=r"val.bin: token id 5\d"):
        load_tokens(tmp_path / "train.bin", vocab_size=50).val_batches(4, 8, 32)
    assert load_tokens(tmp_path / "train.bin", vocab_size=100).batch(0, 0, 8, 32)


def test_the_vocabulary_comes_from_the_data(tmp_path, monkeypatch):
    train, val = np.arange(5000) % 300, np.arange(600) % 400
    d = load_tokens(pair(tmp_path, train, val))
    assert (d.vocab_size, d.vocab_source) == (400, "the largest token id + 1")
    assert "vocabulary 400" in d.describe()
    real = data_module.max_token  # the largest id: read in chunks of the memmap
    monkeypatch.setattr(data_module, "max_token", lambda t: real(t, chunk=7))
    assert load_tokens(tmp_path / "train.bin").vocab_size == 400
    monkeypatch.undo()
    assert real(np.arange(10), chunk=3) == 9
    assert data_module.max_token(np.zeros(0, int)) == -1
    assert load_tokens(tmp_path / "train.bin", vocab_size=512).vocab_size == 512
    with open(tmp_path / "meta.pkl", "wb") as f:  # nanoGPT's
        pickle.dump({"vocab_size": 450, "itos": {0: "a"}, "stoi": {"a": 0}}, f)
    assert load_tokens(tmp_path / "train.bin").vocab_size == 450
    (tmp_path / "tokenizer.json").write_text(json.dumps(
        {"model": {"type": "BPE", "vocab": {"a": 0, "b": 470}},
         "added_tokens": [{"id": 480, "content": "<|endoftext|>"}]}))
    d = load_tokens(tmp_path / "train.bin")
    assert d.vocab_size == 481 and d.vocab_source.endswith("tokenizer.json")
    (tmp_path / "tokenizer.json").unlink()
    with open(tmp_path / "meta.pkl", "wb") as f:  # only plain data is unpickled
        pickle.dump({"vocab_size": 450, "oops": np.int64(3)}, f)
    with pytest.raises(ValueError, match=r"meta.pkl: not a nanoGPT meta.pkl.*numpy"):
        load_tokens(tmp_path / "train.bin")


def test_config_keys_choose_tokens_or_bytes(tmp_path, corpus_dir):
    path = pair(tmp_path, np.arange(5000) % 300, np.arange(600) % 300)
    c = load_config("tiny", [f"data.tokens={path}"])
    d = load_data(c.data)
    assert isinstance(d, TokenData) and d.vocab_size == 300 and d.paths[1].name == "val.bin"
    c = load_config("tiny", [f"data.tokens={path}", "data.token_format=nanogpt",
                             "data.vocab_size=1024", f"data.val_tokens={path}"])
    d = load_data(c.data)
    assert (d.token_format, d.vocab_size, d.val.size) == ("nanogpt", 1024, d.train.size)
    both = load_config("tiny", [f"data.tokens={path}", f"data.paths=('{corpus_dir}',)"])
    with pytest.raises(ValueError, match="set data.tokens .* or data.paths"):
        load_data(both.data)
    stray = load_config("tiny", ["data.vocab_size=512"])
    with pytest.raises(ValueError, match="data.vocab_size=512 is set but data.tokens is not"):
        load_data(stray.data)
    short = load_config("tiny", [f"data.tokens={path}", "data.seq_len=700"])
    with pytest.raises(ValueError, match=r"val.bin holds 600 tokens: too few.*seq_len=700"):
        load_data(short.data)
    text = load_data(load_config("tiny", [f"data.paths=('{corpus_dir}',)",
                                          "data.val_fraction=0.3"]).data)
    same = load_text([corpus_dir], val_fraction=0.3)  # today's data, unchanged
    assert type(text) is TextData and text.vocab_size == 256
    np.testing.assert_array_equal(text.train, same.train)
    # the new keys default to None, as a stored config without them reads: resumes unchanged
    assert all(load_config("default").data[k] is None
               for k in ("tokens", "val_tokens", "token_format", "vocab_size"))


def _text_folder(tmp_path):
    folder = tmp_path / "text"
    folder.mkdir()
    words = "the quick brown fox jumps over the lazy dog; café naïve déjà vu 42 == 6 * 7\n"
    for i in range(6):
        (folder / f"doc{i}.txt").write_text(f"# document {i}\n" + words * (20 + i))
    return folder


def test_tokenize_writes_llmc_files_a_tokenizer_and_caches_them(tmp_path):
    from tokenizers import Tokenizer

    from experiments.tokenize import main, tokenize

    folder, out = _text_folder(tmp_path), tmp_path / "tok"
    m = tokenize([folder], out=out, vocab_size=300, val_fraction=0.3, log=lambda s: None)
    assert m["written"] and m["vocab_size"] <= 300
    d = load_tokens(out / "train.bin", seq_len=16)
    assert d.token_format == "llmc" and d.vocab_size == m["vocab_size"]
    assert d.vocab_source.endswith("tokenizer.json")
    np.testing.assert_array_equal(d.train, np.fromfile(out / "train.bin", "<u2", offset=1024))
    split, _ = split_documents([folder], val_fraction=0.3)  # the split of experiments.data
    assert m["files"] == {"train": len(split["train"]), "val": len(split["val"])}
    assert d.train.size == m["tokens"]["train"] < sum(len(b) for _, b in split["train"]) / 2
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    assert eot == 0 and d.val[0] == eot and np.sum(d.val == eot) == len(split["val"])
    # byte-level BPE: the text comes back exactly (each document after an EOT, which
    # decodes to "")
    assert tok.decode(list(map(int, d.val))) == "".join(b.decode() for _, b in split["val"])
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = tokenize([folder], out=out, vocab_size=300, val_fraction=0.3, log=lambda s: None)
    assert not again["written"]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes  # nothing rewritten
    (folder / "doc0.txt").write_text("changed " * 300)  # other inputs: rewritten
    assert tokenize([folder], out=out, vocab_size=300, val_fraction=0.3,
                    log=lambda s: None)["written"]
    assert not list(out.glob(".*tmp*"))  # no temporary files left
    assert main(["--out", str(out), "--vocab-size", "300", "--val-fraction", "0.3",
                 str(folder)]) == 0
    assert main(["--out", str(out), "--vocab-size", "100", str(folder)]) == 2
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0


# ----------------------------------------------------------------------------- training
# A run on token files, interrupted and resumed on the same tokens in the other format, is
# test_train.py's end-to-end resume (conftest.py's ``token_dirs``).


def test_a_run_records_what_it_read_and_its_models_vocabulary(tiny, tmp_path, text,
                                                               corpus_dir):
    """config.json said vocab 256 for token files of 1,000 ids, and nothing recorded the
    files, bytes or tokens a run read."""
    from experiments import policies
    from experiments.run_spec import config_record, stored_changes

    train, val = np.arange(5000) % 1000, np.arange(700) % 999
    path = pair(tmp_path / "t", train, val)
    d = load_tokens(path)
    assert d.record() == {
        "kind": "tokens", "source": str(path), "token_format": "llmc",
        "files": {"train": 1, "val": 1},
        "paths": {"train": str(path.resolve()), "val": str(path.with_name("val.bin").resolve())},
        "bytes": {"train": 1024 + 2 * 5000, "val": 1024 + 2 * 700},
        "tokens": {"train": 5000, "val": 700},
        "vocab_size": 1000, "vocab_source": "the largest token id + 1"}
    tiny.data.tokens = str(path)
    record = config_record(tiny, d, policies.get("bf16"))
    assert record["model"]["vocab"] == 1000 and tiny.model.vocab == 256
    b = text.record()  # the byte corpus: the files' sizes on disk, one token per byte
    docs = split_documents([corpus_dir], val_fraction=0.3)[0]
    assert b == {"kind": "bytes", "source": str(corpus_dir),
                 "files": {k: len(docs[k]) for k in ("train", "val")},
                 "bytes": {k: sum((corpus_dir / name).stat().st_size for name, _ in docs[k])
                           for k in ("train", "val")},
                 "tokens": {"train": text.train.size, "val": text.val.size},
                 "vocab_size": 256, "vocab_source": "bytes"}
    # a run stored before config.json held what its config resolved to: the config's vocab
    run = tmp_path / "run"
    run.mkdir()
    old = tiny.to_dict()
    (run / "config.json").write_text(json.dumps(old))
    assert stored_changes(run, record, d) == {}  # its model had the data's vocabulary
    old["model"]["vocab"] = 2000
    (run / "config.json").write_text(json.dumps(old))
    assert stored_changes(run, record, d) == {"model.vocab": (2000, 1000)}
