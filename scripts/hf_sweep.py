"""Hugging Face architectures, as a user would bring them, through the pipeline.

Each model is built from a tiny config with random weights (seed 0: no
download), wrapped to take and return plain tensors, exported as a user
would (`torch.onnx.export`, opset 17, a dynamic batch axis), and run through
`python -m deploy run --trials 0 --buckets 1,2` on each target: on llvm built
and validated against ONNX Runtime; on cuda:sm_90 built (validated too where
there is a GPU). The answer: which architectures build, and the one line for
those that do not. `transformers` is not one of the project's dependencies:

    pip install transformers==5.18.0
    python scripts/hf_sweep.py --out results/cpu/DATE/hf-sweep [--models BertModel,GPT2LMHeadModel] [--targets llvm]
        [--exporter dynamo]

Results: sweep.md and sweep.json in --out (resumable: models already in
sweep.json are skipped unless --force), each run's output in --out/logs/.

Decoder LMs are exported with `attention_mask=ones` passed: without any mask,
transformers 5 builds its causal mask with `torch.diff`
(`masking_utils.find_packed_sequence_indices`), which the TorchScript
exporter cannot export ("Exporting the operator 'aten::diff' to ONNX opset
version 17 is not supported"); `--no-lm-mask` shows it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEQ = 16
TIMEOUT_S = 1800  # one model on one target
TEXT = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            max_position_embeddings=64)
DECODER = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, max_position_embeddings=64)
VISION = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32,
              patch_size=8)


def _ids(name="input_ids", n=SEQ):
    return (name, (n,), "int64")


def _img(h=32, w=32):
    return ("pixel_values", (3, h, w), "float32")


def _hidden(m, *a):
    return m(*a, return_dict=False)[0]


def specs(lm_mask: bool = True) -> dict:
    """name -> (model factory, forward(model, *tensors), [(input, per-sample shape, dtype)], output names)."""
    import torch
    import transformers as T

    def lm(m, x):
        mask = {"attention_mask": torch.ones_like(x)} if lm_mask else {}
        return m(input_ids=x, use_cache=False, return_dict=False, **mask)[0]

    text = [_ids()], ["last_hidden_state"]
    image = [_img()], ["last_hidden_state"]
    causal = [_ids()], ["logits"]
    whisper = T.WhisperConfig(vocab_size=100, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                              decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                              suppress_tokens=None, begin_suppress_tokens=None, max_source_positions=16,
                              max_target_positions=32)
    bart = T.BartConfig(vocab_size=100, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64)
    neox = {k: v for k, v in DECODER.items() if k != "num_key_value_heads"}
    return {
        "BertModel": (lambda: T.BertModel(T.BertConfig(**TEXT)), _hidden, *text),
        "RobertaModel": (lambda: T.RobertaModel(T.RobertaConfig(**TEXT)), _hidden, *text),
        "XLMRobertaModel": (lambda: T.XLMRobertaModel(T.XLMRobertaConfig(**TEXT)), _hidden, *text),
        "DistilBertModel": (lambda: T.DistilBertModel(T.DistilBertConfig(
            vocab_size=100, dim=64, n_layers=2, n_heads=2, hidden_dim=128, max_position_embeddings=64)), _hidden, *text),
        "AlbertModel": (lambda: T.AlbertModel(T.AlbertConfig(embedding_size=32, **TEXT)), _hidden, *text),
        "ElectraModel": (lambda: T.ElectraModel(T.ElectraConfig(embedding_size=32, **TEXT)), _hidden, *text),
        "MobileBertModel": (lambda: T.MobileBertModel(T.MobileBertConfig(
            embedding_size=32, intra_bottleneck_size=32, **TEXT)), _hidden, *text),
        "DebertaV2Model": (lambda: T.DebertaV2Model(T.DebertaV2Config(
            relative_attention=True, position_buckets=16, pos_att_type=["p2c", "c2p"], **TEXT)), _hidden, *text),
        "T5EncoderModel": (lambda: T.T5EncoderModel(T.T5Config(
            vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)), _hidden, *text),
        "BartModel": (lambda: T.BartModel(bart),
                      lambda m, a, b: m(input_ids=a, decoder_input_ids=b, use_cache=False, return_dict=False)[0],
                      [_ids(), _ids("decoder_input_ids", 8)], ["last_hidden_state"]),
        "CLIPTextModel": (lambda: T.CLIPTextModel(T.CLIPTextConfig(
            vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=32)), lambda m, x: m(input_ids=x, return_dict=False)[:2], [_ids()],
            ["last_hidden_state", "pooler_output"]),
        "GPT2LMHeadModel": (lambda: T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=100, n_embd=64, n_layer=2, n_head=2, n_positions=64)), lm, *causal),
        "OPTForCausalLM": (lambda: T.OPTForCausalLM(T.OPTConfig(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=2,
            max_position_embeddings=64, word_embed_proj_dim=64)), lm, *causal),
        "LlamaForCausalLM": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**DECODER)), lm, *causal),
        "MistralForCausalLM": (lambda: T.MistralForCausalLM(T.MistralConfig(**DECODER)), lm, *causal),
        "Qwen2ForCausalLM": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**DECODER)), lm, *causal),
        "PhiForCausalLM": (lambda: T.PhiForCausalLM(T.PhiConfig(partial_rotary_factor=0.5, **DECODER)), lm, *causal),
        "GPTNeoXForCausalLM": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(rotary_pct=0.25, **neox)), lm, *causal),
        "BloomForCausalLM": (lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=100, hidden_size=64, n_layer=2,
                                                                      n_head=2)), lm, *causal),
        "ViTModel": (lambda: T.ViTModel(T.ViTConfig(**VISION), add_pooling_layer=False), _hidden, *image),
        "DeiTModel": (lambda: T.DeiTModel(T.DeiTConfig(**VISION), add_pooling_layer=False), _hidden, *image),
        "BeitModel": (lambda: T.BeitModel(T.BeitConfig(use_relative_position_bias=True, **VISION),
                                          add_pooling_layer=False), _hidden, *image),
        "CLIPVisionModel": (lambda: T.CLIPVisionModel(T.CLIPVisionConfig(**VISION)), _hidden, *image),
        "SwinModel": (lambda: T.SwinModel(T.SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[1, 1],
                                                       num_heads=[2, 2], window_size=4)), _hidden, *image),
        "ConvNextModel": (lambda: T.ConvNextModel(T.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                                                                   image_size=32)), _hidden, *image),
        "ResNetModel": (lambda: T.ResNetModel(T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                             layer_type="basic")), _hidden, [_img(64, 64)],
                        ["last_hidden_state"]),
        "MobileViTModel": (lambda: T.MobileViTModel(T.MobileViTConfig(image_size=64)), _hidden, [_img(64, 64)],
                           ["last_hidden_state"]),
        "SegformerModel": (lambda: T.SegformerModel(T.SegformerConfig(
            hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], num_attention_heads=[1, 1, 2, 2],
            decoder_hidden_size=64)), _hidden, [_img(64, 64)], ["last_hidden_state"]),
        "WhisperEncoder": (lambda: T.WhisperModel(whisper).encoder, _hidden, [("input_features", (16, 32), "float32")],
                           ["last_hidden_state"]),
        "Wav2Vec2Model": (lambda: T.Wav2Vec2Model(T.Wav2Vec2Config(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, conv_dim=(16, 16),
            conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2, num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2, vocab_size=32)), _hidden, [("input_values", (400,), "float32")],
            ["last_hidden_state"]),
    }


def export(spec, path: Path, dynamo: bool = False) -> list:
    """The model exported as a user would (torch's TorchScript exporter, or
    with `dynamo` torch.export's, `torch.onnx.export`'s default since torch
    2.9); its inputs."""
    import torch

    factory, forward, inputs, outputs = spec
    torch.manual_seed(0)

    class Wrapped(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, *args):
            return forward(self.model, *args)

    model = Wrapped(factory().eval()).eval()
    args = tuple(torch.randint(0, 10, (2, *shape)) if dtype == "int64" else torch.randn(2, *shape)
                 for _, shape, dtype in inputs)
    names = [i[0] for i in inputs]
    if dynamo:  # (forward(*args): one tuple of per-input shapes)
        batch = torch.export.Dim("batch", min=1, max=4096)
        dynamic = {"dynamic_shapes": (tuple({0: batch} for _ in inputs),)}
    else:
        dynamic = {"dynamic_axes": {n: {0: "batch"} for n in names + list(outputs)}}
    with torch.no_grad():
        torch.onnx.export(model, args, str(path), opset_version=18 if dynamo else 17, dynamo=dynamo,
                          input_names=names, output_names=list(outputs), **dynamic)
    return inputs


def run(onnx_path: Path, inputs, target: str, work: Path, log_path: Path) -> dict:
    """`deploy run` on one target: its outcome and one line."""
    cmd = [sys.executable, "-m", "deploy", "run", "-m", str(onnx_path)]
    for name, shape, dtype in inputs:
        cmd += ["--input", f"{name}:{'x'.join(map(str, shape))}:{dtype}"]
    cmd += ["--target", target, "--trials", "0", "--buckets", "1,2", "--workdir", str(work), "--db-root",
            str(work.parent / "db")]
    start = time.time()
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = f"{e.stdout or ''}{e.stderr or ''}\nerror: timed out after {TIMEOUT_S} s", "timeout"
    log_path.write_text(" ".join(cmd) + "\n\n" + text)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    checked = [ln for ln in lines if ln.startswith("validation ")]
    outcome = "failed" if rc else ("validated" if checked and "PASSED" in checked[-1] else "built")
    return {"outcome": outcome, "line": (errors or checked or lines or [""])[-1][:300],
            "seconds": round(time.time() - start, 1)}


def write(out: Path, rows: dict, targets: list[str]) -> None:
    (out / "sweep.json").write_text(json.dumps(rows, indent=1))
    head = "| model | export | " + " | ".join(targets) + " |\n|---|---|" + "---|" * len(targets) + "\n"
    def cell(text):  # (error lines hold " | ")
        return text.replace("|", "\\|")

    body = "".join(f"| {name} | {cell(r['export'])} | " + " | ".join(
        cell(f"{r[t]['outcome']}: {r[t]['line']}") if t in r else "" for t in targets) + " |\n"
        for name, r in rows.items())
    def count(t, *outcomes):
        return sum(1 for r in rows.values() if r.get(t, {}).get("outcome") in outcomes)

    summary = "; ".join(f"{t}: {count(t, 'built', 'validated')} of {len(rows)} built, {count(t, 'validated')} validated"
                        for t in targets)
    (out / "sweep.md").write_text(f"# Hugging Face architectures through the pipeline\n\n{summary}\n\n{head}{body}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--work", type=Path, help="workdirs (default: a temporary folder)")
    ap.add_argument("--models", default="", help="comma list (default: all)")
    ap.add_argument("--targets", default="llvm,cuda:sm_90")
    ap.add_argument("--force", action="store_true", help="re-run models already in sweep.json")
    ap.add_argument("--no-lm-mask", action="store_true", help="export decoder LMs without an attention mask")
    ap.add_argument("--exporter", choices=("torchscript", "dynamo"), default="torchscript",
                    help="torch.onnx.export(dynamo=False) (opset 17) or dynamo=True (opset 18, torch's default)")
    args = ap.parse_args(argv)
    try:
        table = specs(lm_mask=not args.no_lm_mask)
    except ImportError:
        print("error: transformers is not installed | expected it for this script | pip install transformers==5.18.0",
              file=sys.stderr)
        return 2
    names = [n for n in args.models.split(",") if n] or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        print(f"error: unknown model(s) {', '.join(unknown)} | expected some of {', '.join(table)}", file=sys.stderr)
        return 2
    targets = [t for t in args.targets.split(",") if t]
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    rows = json.loads((args.out / "sweep.json").read_text()) if (args.out / "sweep.json").exists() else {}
    work = args.work or Path(tempfile.mkdtemp(prefix="hf-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name in rows and not args.force:
            continue
        row = {}
        try:
            inputs = export(table[name], work / f"{name}.onnx", dynamo=args.exporter == "dynamo")
            row["export"] = "ok"
        except Exception as e:  # noqa: BLE001 - an export failure is the outcome (PyTorch's, not ours)
            row["export"] = f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        for target in targets if row["export"] == "ok" else []:
            tag = target.replace(":", "_")
            row[target] = run(work / f"{name}.onnx", inputs, target, work / f"{name}-{tag}",
                              args.out / "logs" / f"{name}-{tag}.log")
        rows[name] = row
        print(name, json.dumps(row), flush=True)
        write(args.out, rows, targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
