import json
from pathlib import Path

import pytest

from trainyard_contract import exitcodes
from trainyard_contract.storage import path_to_uri, sha256_file
from trainyard_trainer.data_cli import main


def test_prepare_then_verify_tinycorpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "artifacts"
    assert main(["prepare", "--name", "tinycorpus", "--version", "v1", "--artifact-root", str(root)]) == 0
    out = json.loads(capsys.readouterr().out)
    manifest = root / "datasets" / "tinycorpus" / "v1" / "manifest.json"
    assert out["manifestUri"] == path_to_uri(manifest) and out["sha256"] == sha256_file(manifest)
    assert out["tokenizer"].startswith("bpe1024-") and out["numTokens"] > 500_000 and out["shards"] >= 2

    assert main(["verify", "--artifact-root", str(root)]) == 0
    assert json.loads(capsys.readouterr().out) == out

    shard = manifest.parent / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    assert main(["verify", "--artifact-root", str(root)]) == exitcodes.DATA
    assert "shard-00001.bin has" in capsys.readouterr().err
    assert main(["prepare", "--artifact-root", str(root)]) == exitcodes.DATA
