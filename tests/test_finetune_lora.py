"""examples/finetune_lora.py: a LoRA fine-tune (peft) of a tiny Llama in funcamp's eager train step.

One module-scoped run of the example's ``main`` (6 steps, bfloat16 compute) serves the checks: only the adapters
are in the train state and the optimizer state, the base weights come out bit for bit as they went in, the
adapters moved, the adapter files hold the trained tensors, the merged model reloaded from ``save_pretrained``
gives the in-memory merged model's logits, and TensorBoard got the main job's tags. The base and the initial
adapters are rebuilt with the example's own builders and seed (the same random draws, in the same order).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import funcamp as fa

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import finetune_lora  # noqa: E402

ARGS = ["--steps", "6", "--log-every", "3", "--batch-size", "4", "--block-size", "32", "--eval-batches", "1"]
ARGS += ["--lr", "1e-2", "--quiet"]
IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
# The merged model and its save_pretrained/from_pretrained copy: the same float32 tensors, the same kernels (0.0
# measured on this CPU); the tolerance leaves room for a device whose kernels are not run-to-run deterministic.
RELOAD_ATOL = 1e-6
# The unmerged peft model (W x + s B A x) against the merged one ((W + s B A) x), float32: rounding only
# (measured 3.0e-7 here, on logits of at most 0.74).
MERGE_ATOL = 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finetune_lora")
    argv = [*ARGS, "--output", str(out)]
    results = finetune_lora.main(argv)
    args = finetune_lora.parse_args(argv)
    base = finetune_lora.build_base(args)[0]  # the base as the example built it (same seed)
    initial = finetune_lora.add_lora(finetune_lora.build_base(args)[0], args)  # and its initial adapters
    return {**results, "args": args, "base": base.eval(), "initial": initial, "out": out}


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS, use_cache=False).logits


def test_only_the_adapters_are_in_the_train_and_optimizer_state(run):
    state, initial = run["state"], run["initial"]
    lora = {k for k, p in initial.named_parameters() if p.requires_grad}
    assert lora and all(".lora_A." in k or ".lora_B." in k for k in lora)
    assert set(state.params) == lora
    assert all(p.dtype == torch.float32 for p in state.params.values())  # float32 masters
    # AdamW's two moments of each adapter, and a step count or two: nothing of the base
    extra = fa.tree_bytes(state.opt_state) - 2 * fa.tree_bytes(state.params)
    assert 0 <= extra <= 16, extra
    assert not set(run["apply_fn"].frozen) & lora


def test_base_weights_come_out_bitwise_and_only_the_adapted_ones_merge(run):
    base, merged, state, initial = run["base"].state_dict(), run["merged"].state_dict(), run["state"], run["initial"]
    assert set(merged) == set(base)
    adapted = {
        k.removeprefix("base_model.model.").replace(".base_layer", "")
        for k in initial.state_dict()
        if ".base_layer." in k
    }
    assert adapted <= set(base) and len(adapted) == 4, adapted  # peft's Llama default: q_proj and v_proj, 2 layers
    for name, before in base.items():
        after = merged[name]
        assert after.dtype == before.dtype, name
        if name in adapted:
            assert not torch.equal(after, before), name
            prefix = "base_model.model." + name.removesuffix(".weight")
            a, b = state.params[prefix + ".lora_A.default.weight"], state.params[prefix + ".lora_B.default.weight"]
            scale = run["args"].alpha / run["args"].rank
            torch.testing.assert_close(after - before, scale * b @ a, rtol=0, atol=1e-6)
        else:
            assert torch.equal(after, before), name  # bit for bit: embeddings, norms, k/o_proj, MLP, lm_head


def test_adapters_moved_and_the_adapter_files_hold_them(run):
    state, initial = run["state"], dict(run["initial"].named_parameters())
    for name, trained in state.params.items():
        if ".lora_B." in name:
            assert not initial[name].any() and trained.abs().max() > 1e-4, name  # peft starts B at 0
        else:
            assert not torch.equal(trained, initial[name]), name
    fresh = finetune_lora.build_base(run["args"])[0]
    reloaded = peft.PeftModel.from_pretrained(fresh, str(run["adapter_dir"]))
    weights = dict(reloaded.named_parameters())
    for name, trained in state.params.items():
        assert torch.equal(weights[name], trained), name
    torch.testing.assert_close(_logits(reloaded), _logits(run["merged"]), rtol=0, atol=MERGE_ATOL)


def test_merged_model_reloads_with_the_same_logits(run):
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(run["merged_dir"]))
    assert type(reloaded) is type(run["merged"]) and not isinstance(reloaded, peft.PeftModel)
    merged_logits = _logits(run["merged"])
    torch.testing.assert_close(_logits(reloaded), merged_logits, rtol=0, atol=RELOAD_ATOL)
    # and the fine-tune is in it: the base's logits are elsewhere
    assert (merged_logits - _logits(run["base"])).abs().max() > 100 * RELOAD_ATOL


def test_tensorboard_tags_and_the_loss_falls(run):
    acc = EventAccumulator(str(run["out"]), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    tags = ("train/loss", "train/grad_norm", "train/learning_rate", "amp/loss_scale", "amp/grads_finite")
    for tag in (*tags, "perf/tokens_per_second"):
        assert scalars[tag] == [3, 6], tag
    assert scalars["val/loss"] == [0, 6]
    val = run["history"]["val_loss"]
    assert val[-1][1] < val[0][1], val


def _byte_tokenizer():
    """A byte-level BPE tokenizer without merges (256 tokens, one per byte), as a checkpoint folder holds one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_checkpoint_folder_with_its_tokenizer(tmp_path):
    """--model FOLDER: from_pretrained of the model and its tokenizer (the path of a real checkpoint, offline),
    --data tokenized with it; the merged folder holds the tokenizer too."""
    args = finetune_lora.parse_args([])
    base = finetune_lora.build_base(args)[0]
    base.save_pretrained(tmp_path / "ckpt")
    tokenizer = _byte_tokenizer()
    tokenizer.save_pretrained(tmp_path / "ckpt")
    text = "LoRA trains two small matrices per adapted weight. " * 40
    (tmp_path / "data.txt").write_text(text, encoding="utf-8")
    argv = ["--model", str(tmp_path / "ckpt"), "--data", str(tmp_path / "data.txt"), "--output", str(tmp_path / "out")]
    results = finetune_lora.main([*argv, "--steps", "2", "--batch-size", "2", "--block-size", "16", "--quiet"])
    assert int(results["state"].step) == 2
    assert len(tokenizer(text)["input_ids"]) == len(text.encode())  # bytes: the same windows as --model tiny
    again = transformers.AutoTokenizer.from_pretrained(str(results["merged_dir"]))
    assert again(text)["input_ids"] == tokenizer(text)["input_ids"]
    with pytest.raises(SystemExit, match="--model .*nowhere: cannot load a causal LM and its tokenizer"):
        finetune_lora.main(["--model", str(tmp_path / "nowhere"), "--output", str(tmp_path / "out2")])
