"""bench/gpu_serving.py end to end on the CPU: a tiny random checkpoint, both topologies,
streaming clients in two processes; every request completes and the report has its rows."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.slow
def test_tiny_shape_serves_both_topologies_without_errors(tmp_path):
    from tandem.pipeline import model_store

    if not model_store.is_model_dir(model_store.default_model_dir()):
        pytest.skip("default model not fetched (tandem model fetch): its tokenizer is the checkpoint's")
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("gpu_serving", BENCH / "gpu_serving.py")
    gs = sys.modules["gpu_serving"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    out = tmp_path / "gs"
    rc = gs.main(["--shape", "tiny", "--make-model", str(tmp_path / "m"), "--clients", "1,3", "--rounds", "1",
                  "--prompt-tokens", "48", "--max-tokens", "8", "--parallel", "4", "--engine-bench", "none",
                  "--client-procs", "2", "--port", "8391", "--base-port", "6691", "--out", str(out)])
    res = json.loads(Path(f"{out}.json").read_text())
    assert rc == 0, res
    assert set(res["topologies"]) == {"hybrid", "disaggregated"}
    for t in res["topologies"].values():
        assert [r["clients"] for r in t["levels"]] == [1, 3]
        assert all(r["requests"] == r["clients"] and r["errors"] == 0 and r["tok_per_s"] > 0 for r in t["levels"])
    assert "| hybrid | 3 |" in Path(f"{out}.md").read_text()


def test_checkpoint_vocabulary_is_the_largest_token_id_plus_one(tmp_path):
    """Added tokens inside the vocabulary do not enlarge it (a count did: 49,169 for
    SmolLM2's 49,152, which no longer divided by 8 and kept the GPU's one-kernel argmax and
    captured step off)."""
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("gpu_serving", BENCH / "gpu_serving.py")
    gs = sys.modules["gpu_serving"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    tok = tmp_path / "tok"
    tok.mkdir()
    vocab = {f"t{i}": i for i in range(64)}
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": [{"id": 0}, {"id": 5}]}))
    gs.make_model(tmp_path / "m", "tiny", tok)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["vocab_size"] == 64
