"""Shape buckets over a dimension besides the batch: a BERT-style encoder
built at two sequence lengths, requests of any length padded to the
smallest bucket that holds them and their outputs cut back, checked
against the unpadded model."""

import concurrent.futures
import json
import subprocess
import sys

import numpy as np
import pytest

import deploy
from deploy import config, pipeline, shapes
from deploy.errors import ConfigError, ShapeError
from deploy.tuning import database as dbs

SEQ = {"name": "seq", "inputs": ["input_ids", "attention_mask"], "outputs": ["last_hidden_state"],
       "mask": "attention_mask", "buckets": [8, 16]}


def bert_config(**dim):
    return config.from_dict({
        "model": {"source": "bert", "size": "small", "seed": 0, "dims": [{**SEQ, **dim}]},
        "llvm": {"buckets": [1, 4], "tune_buckets": [1], "trials": 0, "budget": ""},
    })


# ------------------------------------------------------------------ units ---


def test_bucket_labels_order_and_batch_only_buckets_read_as_their_batch():
    b = shapes.parse("4-seq128")
    assert (b.batch, b.dims, b.label) == (4, (("seq", 128),), "4-seq128")
    assert shapes.parse("8") == 8 and {8: "x"}[shapes.parse("8")] == "x" and shapes.parse("8").label == "8"
    assert shapes.parse("4-seq128") != 4
    cfg = bert_config()
    got = [b.label for b in shapes.all_buckets(cfg.llvm, cfg.model.dims)]
    assert got == ["1-seq8", "4-seq8", "1-seq16", "4-seq16"]
    assert [b.label for b in shapes.tuned_buckets(cfg.llvm, cfg.model.dims)] == ["1-seq8", "1-seq16"]
    with pytest.raises(ShapeError):
        shapes.parse("seq8")


def test_pad_fit_and_cut():
    (d,) = bert_config().model.dims
    assert shapes.fit((("seq", 5),), (d,)) == (("seq", 8),)
    assert shapes.fit((("seq", 9),), (d,)) == (("seq", 16),)
    with pytest.raises(ShapeError, match="longer than its largest bucket"):
        shapes.fit((("seq", 17),), (d,))
    ids = np.arange(1, 6).reshape(1, 5)
    padded = shapes.pad_to(ids, "input_ids", (("seq", 5),), (("seq", 8),), (d,))
    assert padded.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    # two dimensions on one input, each padded with its own value
    rows = config.DimSpec("rows", ("x",), (4,), axis=1, pad=-1.0)
    cols = config.DimSpec("cols", ("x",), (3,), axis=2, pad=7.0)
    x = shapes.pad_to(np.ones((1, 2, 2)), "x", (("rows", 2), ("cols", 2)), (("rows", 4), ("cols", 3)), (rows, cols))
    assert x[0].tolist() == [[1, 1, 7], [1, 1, 7], [-1, -1, 7], [-1, -1, 7]]  # (the later dimension last)
    out = np.ones((1, 8, 3))
    assert shapes.cut(out, "last_hidden_state", (("seq", 5),), (d,)).shape == (1, 5, 3)
    assert shapes.cut(np.ones((1, 3)), "pooled", (("seq", 5),), (d,)).shape == (1, 3)


@pytest.mark.parametrize("dim, match", [
    ({"name": "seq2"}, "no digits"),
    ({"name": "s2s"}, "no digits"),
    ({"mask": "token_type_ids"}, "mask is not one of its inputs"),
    ({"buckets": []}, "buckets"),
    ({"axis": 0}, "axis 0 is the batch"),
])
def test_bad_dimensions_are_one_line_config_errors(dim, match):
    with pytest.raises(ConfigError, match=match):
        bert_config(**dim)


def test_dimensions_are_checked_against_an_onnx_models_inputs():
    with pytest.raises(ConfigError, match="names an input the model does not have"):
        config.from_dict({"model": {"source": "m.onnx", "inputs": [{"name": "ids", "shape": [16], "dtype": "int64"}],
                                    "dims": [{"name": "seq", "inputs": ["input_ids"], "buckets": [8]}]}})


def test_dim_buckets_override():
    (d,) = config.parse_dim_buckets("seq=4,12", bert_config().model.dims)
    assert d.buckets == (4, 12)
    with pytest.raises(ConfigError, match="for a dimension the config declares"):
        config.parse_dim_buckets("len=4", bert_config().model.dims)


def test_dim_buckets_for_a_model_without_dimensions_is_one_line():
    r = subprocess.run([sys.executable, "-m", "deploy", "run", "-m", "tiny_mlp", "--target", "llvm",
                        "--dim-buckets", "seq=4", "--workdir", "/nonexistent/never-made"],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "--dim-buckets for a model without dimensions" in r.stderr and "Traceback" not in r.stderr


def test_each_length_has_its_own_tuning_database(llvm_target, tmp_path):
    cfg = bert_config()
    from deploy.config import InputSpec

    inputs = (InputSpec("input_ids", (16,), "int64"), InputSpec("attention_mask", (16,), "int64"))
    keys, dirs = pipeline.db_keys(cfg, cfg.llvm, llvm_target, inputs, tmp_path, cfg.model.dims)
    b = shapes.parse("1-seq8")
    assert keys[b]["inputs"][0]["shape"] == [1, 8] and keys[b]["dims"] == {"seq": 8}
    assert dirs[b].name.endswith("-b1-seq8") and dirs[shapes.parse("1-seq16")] != dirs[b]
    # a batch-only model's key is what it always was (committed databases keep matching)
    assert "dims" not in dbs.database_key("m", inputs, 1, cfg.llvm, llvm_target)


# ------------------------------------------------------- the built package ---


@pytest.fixture(scope="module")
def bert_package(tmp_path_factory, llvm_target):
    ws = tmp_path_factory.mktemp("bert-seq")
    summary = pipeline.run(bert_config(), llvm_target, ws, db_root=ws / "db")
    return ws / "package", summary


def test_every_length_and_batch_is_built_and_validated_padded_too(bert_package):
    folder, summary = bert_package
    m = json.loads((folder / "manifest.json").read_text())
    assert set(m["buckets"]) == {"1-seq8", "4-seq8", "1-seq16", "4-seq16"}
    assert m["dims"][0]["name"] == "seq" and m["validation"]["passed"]
    report = json.loads((folder / "validation.json").read_text())
    padded = [k for k in report["buckets"] if "padded from" in k]
    assert "4-seq16 padded from 4-seq12" in padded and "1-seq8 padded from 1-seq6" in padded
    assert set(summary["latency"]) == set(m["buckets"])


def test_requests_of_any_length_match_the_unpadded_model(bert_package):
    import onnxruntime as ort

    pred = deploy.load(bert_package[0])
    sess = ort.InferenceSession(str(bert_package[0].parent / "export" / "model.onnx"))
    rng = np.random.default_rng(3)
    for batch, length in ((1, 3), (2, 8), (3, 11), (6, 16)):  # 6 rows: pieces of bucket 4
        ids = rng.integers(0, 10, (batch, length)).astype("int64")
        mask = np.ones_like(ids)
        mask[:, length - 1:] = 0 if length > 2 else 1
        got = pred(ids, mask)
        ref = sess.run(None, {"input_ids": ids, "attention_mask": mask})
        assert got["last_hidden_state"].shape == (batch, length, 64)
        np.testing.assert_allclose(got["last_hidden_state"], ref[0], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got["pooled"], ref[1], rtol=1e-4, atol=1e-4)
    with pytest.raises(ShapeError, match="longer than its largest bucket"):
        pred(np.zeros((1, 17), "int64"), np.zeros((1, 17), "int64"))
    with pytest.raises(ShapeError, match="disagree on the length of dimension 'seq'"):
        pred(np.zeros((1, 5), "int64"), np.zeros((1, 6), "int64"))
    assert pred.bucket_for(3) == shapes.parse("4-seq16")  # no lengths given: the longest


def test_a_package_missing_a_length_is_refused(bert_package, tmp_path):
    import shutil

    from deploy.errors import StaleArtifactError

    folder = tmp_path / "pkg"
    shutil.copytree(bert_package[0], folder)
    m = json.loads((folder / "manifest.json").read_text())
    m["dims"][0]["buckets"] = [8, 16, 32]  # a length the package holds no module for
    (folder / "manifest.json").write_text(json.dumps(m))
    from deploy import runtime

    with pytest.raises(StaleArtifactError, match="every batch at every length"):
        runtime.Predictor(folder, manifest=m)


def test_requests_of_different_lengths_share_a_batch_and_get_their_own_back(bert_package):
    pred = deploy.load(bert_package[0])
    short = pred.random_inputs(shapes.Bucket((("seq", 5),), 1), seed=1)
    long = pred.random_inputs(shapes.Bucket((("seq", 12),), 2), seed=2)
    batch = pred.stage([short, long])
    assert batch.bucket == shapes.parse("4-seq16")
    parts = pred.split(batch, pred.collect(pred.launch(batch)))
    for part, alone in zip(parts, (pred(*short), pred(*long))):
        for k in alone:
            assert part[k].shape == alone[k].shape
            np.testing.assert_allclose(part[k], alone[k], rtol=1e-5, atol=1e-5)


def test_the_server_takes_any_length_and_answers_each_request_with_its_own(bert_package):
    import tritonclient.http as triton

    from deploy.serving import serve

    server = serve.start(config.serve_config(port=0, max_queue_delay_ms=50.0), bert_package[0])
    try:
        client = triton.InferenceServerClient(server.url.removeprefix("http://"))
        meta = client.get_model_metadata(server.app.model)
        assert meta["inputs"][0]["shape"] == [-1, -1] and meta["outputs"][0]["shape"] == [-1, -1, 64]
        pred = deploy.load(bert_package[0])

        def ask(length):  # a client per thread: tritonclient's (gevent) connections are not shared across threads
            client = triton.InferenceServerClient(server.url.removeprefix("http://"))
            ids = np.random.default_rng(length).integers(0, 10, (1, length)).astype("int64")
            tensors = []
            for name, a in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
                t = triton.InferInput(name, list(a.shape), "INT64")
                t.set_data_from_numpy(a)
                tensors.append(t)
            out = client.infer(server.app.model, tensors).as_numpy("last_hidden_state")
            return out, pred(ids, np.ones_like(ids))["last_hidden_state"]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for got, want in pool.map(ask, (3, 7, 9, 16)):
                assert got.shape == want.shape
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # one request too long is refused alone, before it can share (and fail) a batch
        ids = np.zeros((1, 17), "int64")
        tensors = []
        for name in ("input_ids", "attention_mask"):
            t = triton.InferInput(name, [1, 17], "INT64")
            t.set_data_from_numpy(ids)
            tensors.append(t)
        with pytest.raises(Exception, match="longer than its largest bucket"):
            client.infer(server.app.model, tensors)
    finally:
        server.stop()


def test_sequence_buckets_build_for_cuda_sm90(tmp_path):
    """Every TIR pass of the CUDA build runs here (no GPU needed)."""
    from deploy import targets

    cfg = config.from_dict({"model": {"source": "bert", "size": "small", "dims": [SEQ]},
                            "cuda": {"buckets": [1, 4], "tune_buckets": [1]}})
    pipeline.run(cfg, targets.resolve("cuda:sm_90"), tmp_path / "ws", db_root=tmp_path / "db")
    m = json.loads((tmp_path / "ws" / "package" / "manifest.json").read_text())
    assert set(m["buckets"]) == {"1-seq8", "4-seq8", "1-seq16", "4-seq16"} and m["precision"] == "fp16"
