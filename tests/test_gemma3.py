"""Gemma 3 (interleaved sliding-window layers) on tiny random checkpoints: config parsing (every
format), parity with transformers through every attention implementation in fixed-shape steps
(chunked prefill with the causal kernel, decode, tree verification), speculative == plain decoding
for every proposer with windows much shorter than the prompts, a draft trained on it, a
multimodal checkpoint's text model, and ``longspec convert`` of a Gemma 3 GGUF.

The whole-battery parity (prefill / decode / verify / commit in every layout) runs in
``test_target_parity.py`` with the ``gemma3-*`` cases; here the model has 6 layers (globals at
2 and 5), window 8, head_dim 32 and its own softmax scale (query_pre_attn_scalar 24)."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from longspec import GenerationConfig, load_target
from longspec.attention import triton_kernels
from longspec.config import ModelConfig
from longspec.decoding.generator import Generator
from longspec.spec.proposers import default_tree
from longspec.engine.prefill import ChunkedPrefill
from longspec.spec.proposers import LongSpecProposer, PromptLookup
from longspec.spec.streaming import StreamingSelfSpec
from longspec.spec.tree import TreeSpec
from longspec.models.checkpoint import load_draft

from conftest import assert_close, hf_logits, randomize_
from test_draft import noisy_draft
from test_speculative import RandomDraft
from test_target_parity import TREE_A, TREE_B, ancestors_or_self, depths, leaves, rand_tokens, tree_mask

TRITON = ["triton"] if triton_kernels.available() else []
IMPLS = ["reference", "sdpa", "matmul"] + TRITON
ATOL = 1e-4


@pytest.fixture(scope="module")
def gemma(tiny_model_factory):
    """(hf model, checkpoint folder) of the tiny Gemma 3."""
    return tiny_model_factory("gemma3-e2e", "gemma3", seed=21)


def test_the_window_and_the_local_rope_change_the_logits(gemma):
    """Sanity check of the set-up: with every layer global, or one RoPE base for all layers, the
    logits of a 60-token sequence move far beyond the tolerance."""
    hf, _ = gemma
    ids = rand_tokens(60, 1)
    ref = hf_logits(hf, ids)
    for change in ({"sliding_window": 1000},
                   {"rope_parameters": {t: {"rope_type": "default", "rope_theta": 1e6}
                                        for t in ("full_attention", "sliding_attention")}}):
        other = type(hf)(transformers.Gemma3TextConfig(**{**hf.config.to_dict(), **change})).eval()
        other.load_state_dict(hf.state_dict())
        assert (hf_logits(other, ids) - ref).abs().max() > 1e-2, change


def test_config_formats(gemma):
    """transformers 5's config.json (layer_types, per-layer-type rope_parameters) and the hub's
    (rope_theta, rope_local_base_freq, sliding_window_pattern) give the same model; the Gemma 3
    270M shape parses as documented."""
    _, path = gemma
    cfg = json.loads((path / "config.json").read_text())
    ours = ModelConfig.from_hf(cfg)
    assert ours.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert (ours.sliding_window, ours.rope.theta, ours.rope_local.theta) == (8, 1e6, 1e4)
    assert ours.norm_plus_one and ours.sandwich_norms and ours.qk_norm and ours.tie_word_embeddings
    assert ours.hidden_act == "gelu_pytorch_tanh" and ours.embed_scale == 64 ** 0.5
    assert ours.query_pre_attn_scalar == 24 and ours.final_logit_softcapping is None
    hub = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern")}
    hub.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=3, rope_scaling=None)
    assert ModelConfig.from_hf(hub) == ours
    shape_270m = dict(hub, num_hidden_layers=18, hidden_size=640, intermediate_size=2048, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=256, sliding_window=512, sliding_window_pattern=6,
                      vocab_size=262144, max_position_embeddings=32768, query_pre_attn_scalar=256)
    c = ModelConfig.from_hf(shape_270m)
    assert [i for i in range(18) if not c.is_sliding(i)] == [5, 11, 17] and not c.is_sliding(-1)
    for bad, message in (({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
                         ({"layer_types": ["sliding_attention"] * 5}, "layer_types"),
                         ({"hidden_activation": "relu"}, "hidden_act")):
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf({**cfg, **bad})


def _tree_logits_check(hf, target, prompts, cache, n_keys, atol):
    """Verifies TREE_A / TREE_B (nodes at different depths) after ``prompts`` in ``cache`` and
    checks every node against transformers on prefix + root-to-node path."""
    trees = [TREE_A, TREE_B]
    tokens = torch.tensor([rand_tokens(len(t), 300 + i) for i, t in enumerate(trees)])
    mask = torch.stack([tree_mask(t) for t in trees])
    positions = cache.lengths[:, None] + torch.stack([depths(t) for t in trees])
    logits = target.verify(tokens, positions, mask, cache, n_keys=n_keys)
    for b, (p, parents) in enumerate(zip(prompts, trees)):
        for leaf in leaves(parents):
            path = ancestors_or_self(parents, leaf)
            ref = hf_logits(hf, p + tokens[b, path].tolist())
            assert_close(logits[b, path], ref[len(p):], atol, f"row {b} path {path}")
    cache.discard()


@pytest.mark.parametrize("impl", IMPLS)
def test_fixed_shape_steps_through_every_attention_impl(gemma, impl):
    """The engine's fixed-shape steps (n_keys = the capacity) with each attention implementation:
    chunked prefill (16-token causal chunks, the causal kernel for Triton), decode, and a tree
    verification, prompts 5 and 2.5 windows long, float32, against transformers."""
    hf, path = gemma
    target = load_target(path)
    target.attention_impl = impl
    prompts = [rand_tokens(41, 11), rand_tokens(20, 12)]
    cache = target.new_cache(2, 96)
    prefill = ChunkedPrefill(target, cache, chunk=16, n_keys=96, cuda_graphs=False)
    for row, prompt in enumerate(prompts):
        assert_close(prefill(row, prompt)[0], hf_logits(hf, prompt)[-1], ATOL, f"prefill row {row}")
    conts = [rand_tokens(3, 20 + b) for b in range(2)]
    for t in range(3):
        logits = target.decode(torch.tensor([c[t] for c in conts]), cache, n_keys=96)
        for b in range(2):
            assert_close(logits[b], hf_logits(hf, prompts[b] + conts[b][:t + 1])[-1], ATOL, f"decode {t} row {b}")
    _tree_logits_check(hf, target, [p + c for p, c in zip(prompts, conts)], cache, 96, ATOL)


@pytest.mark.parametrize("impl", TRITON)
def test_triton_in_float16_matches_the_reference(gemma, impl):
    """The Triton kernels (prefix window, causal chunk window, tree) in float16 against the
    float16 reference path of the same model."""
    _, path = gemma
    outs = {}
    for which in ("reference", impl):
        target = load_target(path, dtype=torch.float16)
        target.attention_impl = which
        cache = target.new_cache(1, 64)
        prefill = ChunkedPrefill(target, cache, chunk=16, n_keys=64, cuda_graphs=False)
        first = prefill(0, rand_tokens(37, 5))
        verify = target.verify(torch.tensor([rand_tokens(7, 6)]), cache.lengths[:, None] + depths(TREE_A)[None],
                               tree_mask(TREE_A)[None], cache, n_keys=64)
        outs[which] = torch.cat([first, verify[0]])
    scale = outs["reference"].abs().max()
    assert (outs[impl] - outs["reference"]).abs().max() <= 2e-2 * scale


def repetitive_prompts():
    """Two prompts (44 and 30 tokens: 5.5 and 3.75 windows) with repeats for the lookups."""
    gen = torch.Generator().manual_seed(4)
    base = torch.randint(0, 160, (7,), generator=gen).tolist()
    return [(base * 3 + torch.randint(0, 160, (23,), generator=gen).tolist())[:44],
            torch.randint(0, 160, (16,), generator=gen).tolist() + base * 2]


PROPOSERS = {
    "pld": lambda target: PromptLookup(max_ngram=3),
    "streaming": lambda target: StreamingSelfSpec(window=8, sinks=2),
    "random": lambda target: RandomDraft(seed=3),
    "longspec": lambda target: LongSpecProposer(noisy_draft(target, window=6, seed=2)),
    "hybrid": lambda target: LongSpecProposer(noisy_draft(target, window=6, seed=2), lookup=PromptLookup()),
}


@pytest.mark.parametrize("proposer,tree", [(p, t) for p in ("pld", "streaming", "random", "longspec")
                                           for t in ("chain:4", "3,4,4")] + [("hybrid", default_tree("hybrid"))])
def test_greedy_speculative_equals_plain(gemma, proposer, tree):
    _, path = gemma
    target = load_target(path)
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    prompts = repetitive_prompts()
    expected = Generator(target).generate(prompts, config).sequences
    out = Generator(target, proposer=PROPOSERS[proposer](target), tree=TreeSpec.parse(tree)).generate(prompts, config)
    assert out.sequences == expected


@pytest.mark.parametrize("impl", TRITON)
def test_longspec_and_hybrid_through_the_triton_kernels(gemma, impl):
    """Target (windowed trees and chunks) and draft (ring buffer, cross-attention into the last,
    global, layer) through the Triton kernels: the plain decoding's tokens."""
    _, path = gemma
    target = load_target(path)
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    prompts = repetitive_prompts()
    expected = Generator(target).generate(prompts, config).sequences
    target.attention_impl = impl
    for proposer in ("longspec", "hybrid"):
        tree = TreeSpec.parse(default_tree("hybrid") if proposer == "hybrid" else "3,4,4")
        out = Generator(target, proposer=PROPOSERS[proposer](target), tree=tree).generate(prompts, config)
        assert out.sequences == expected, proposer


def test_a_draft_trains_on_gemma3_with_head_dim_256(tiny_model_factory, tmp_path):
    """The trainer on a Gemma 3 target of head_dim 256 (scaled embeddings, (1 + w) final norm,
    anchor-offset positions cut by the sliding layers' windows): the held-out loss falls, the
    checkpoint loads, and the trained draft is a lossless proposer."""
    from test_training import CharTokenizer, small_config, write_corpus
    from longspec.training import train

    _, path = tiny_model_factory("gemma3-hd256", "gemma3", seed=22, head_dim=256, num_attention_heads=2,
                                 num_key_value_heads=1, query_pre_attn_scalar=256, max_position_embeddings=512)
    target = load_target(path)
    corpus = write_corpus(tmp_path / "grammar.jsonl")
    result = train(small_config(tmp_path / "run", corpus, steps=30, eval_every=30), tokenizer=CharTokenizer(),
                   target=target)
    evals = [r["eval_loss"] for r in result.history if "eval_loss" in r]
    assert evals[-1] < 0.8 * evals[0], evals
    draft = load_draft(tmp_path / "run", target)
    assert draft.config.head_dim == 256 and draft.config.target_architecture == "Gemma3ForCausalLM"
    prompts = [CharTokenizer().encode("the big cat sees the dog. the small bird likes the fish. the red")]
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    out = Generator(target, proposer=LongSpecProposer(draft), tree=TreeSpec.parse("3,4,4")).generate(prompts, config)
    assert out.sequences == Generator(target).generate(prompts, config).sequences


def test_multimodal_checkpoint_loads_its_text_model(gemma, tmp_path):
    """A ``gemma3`` (Gemma3ForConditionalGeneration) folder: the text model's config under
    ``text_config`` and its weights under ``model.language_model.``, the vision tower skipped."""
    hf, path = gemma
    text = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model"}, "tie_word_embeddings": True}))
    state = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(path / "model.safetensors").items()}
    state["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3, 2, 2)
    save_file(state, str(tmp_path / "model.safetensors"))
    target = load_target(tmp_path)
    ids = rand_tokens(30, 7)
    cache = target.new_cache(1, 32)
    logits = target.prefill(torch.tensor([ids]), torch.tensor([30]), cache, all_logits=True)[0]
    assert_close(logits, hf_logits(hf, ids), ATOL, "multimodal text model")


# ------------------------------------------------------------------------------------ GGUF

PIECES = ["<pad>", "<eos>", "<bos>", "<unk>", "▁"] + [f"▁{w}" for w in "the a cat dog sees big red".split()] + \
    list("abcdefghijklmnopqrstuvwxyz.,")


def write_tiny_gemma3_gguf(hf, file) -> None:
    """A Gemma 3 GGUF as llama.cpp writes one (float32 tensors under llama.cpp's names, norms
    stored as 1 + w, a sentencepiece vocabulary) from the transformers model ``hf``."""
    import gguf

    c = hf.config
    writer = gguf.GGUFWriter(str(file), "gemma3")
    writer.add_name("tiny-gemma3")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_sliding_window(c.sliding_window)
    writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    vocab = PIECES + [f"<unused{i}>" for i in range(c.vocab_size - len(PIECES))]
    writer.add_token_list(vocab)
    writer.add_token_scores([0.0 if i < 4 else -float(i) for i in range(len(vocab))])
    writer.add_token_types([3, 3, 3, 2] + [1] * (len(PIECES) - 4) + [4] * (len(vocab) - len(PIECES)))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, c.num_hidden_layers)
    for key, value in hf.state_dict().items():
        if key == "lm_head.weight":
            continue  # tied
        name = names.get_name(key, try_suffixes=(".weight",))
        value = value.float() + (1.0 if "norm" in key else 0.0)
        writer.add_tensor(name, value.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_convert_a_gemma3_gguf(tmp_path):
    """``convert_gguf`` of a Gemma 3 GGUF: the converted folder loads and gives the original
    model's logits (the GGUF's pattern of 6 and llama.cpp's softmax scale 1/sqrt(key_length)),
    and the tokenizer comes from the file's vocabulary."""
    pytest.importorskip("gguf")
    from longspec.convert import convert_gguf

    config = transformers.Gemma3TextConfig(
        vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=8, max_position_embeddings=256, query_pre_attn_scalar=32,
        bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    hf = randomize_(transformers.Gemma3ForCausalLM(config).eval(), 23)
    write_tiny_gemma3_gguf(hf, tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "converted")
    target = load_target(out)
    assert target.config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert target.config.query_pre_attn_scalar == 32
    ids = rand_tokens(40, 8)
    cache = target.new_cache(1, 48)
    logits = target.prefill(torch.tensor([ids]), torch.tensor([40]), cache, all_logits=True)[0]
    assert_close(logits, hf_logits(hf, ids), ATOL, "converted GGUF")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer.encode("the big cat", add_special_tokens=False)
    assert tokenizer.decode(ids) == "the big cat" and all(4 <= i < len(PIECES) for i in ids)
    assert tokenizer.convert_tokens_to_ids("▁cat") == PIECES.index("▁cat")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (2, 1)


def test_convert_refuses_a_tokenizer_rebuilt_as_single_characters_and_takes_a_given_one(tmp_path):
    """A big vocabulary rebuilt so that text falls apart into characters (transformers 5.17 on Gemma
    3's GGUF: 1.0 bytes per token instead of 3.9) is refused with a clear error; ``--tokenizer DIR``
    takes the model's own tokenizer files instead."""
    pytest.importorskip("gguf")
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from longspec.cli import main
    from longspec.convert import TOKENIZER_SAMPLE, check_tokenizer, convert_gguf

    chars = sorted(set(TOKENIZER_SAMPLE))
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{ch: 4 + i for i, ch in enumerate(chars)}}
    vocab.update({f"<unused{i}>": len(vocab) + i for i in range(20000)})
    chars_only = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    chars_only.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    broken = transformers.PreTrainedTokenizerFast(tokenizer_object=chars_only, unk_token="<unk>")
    with pytest.raises(ValueError, match=r"1\.00 characters per token .* longspec convert --tokenizer DIR"):
        check_tokenizer(broken, "this tokenizer")

    config = transformers.Gemma3TextConfig(
        vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=8, max_position_embeddings=256, query_pre_attn_scalar=32,
        bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    write_tiny_gemma3_gguf(randomize_(transformers.Gemma3ForCausalLM(config).eval(), 23), tmp_path / "tiny.gguf")
    first = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "first")
    check_tokenizer(transformers.AutoTokenizer.from_pretrained(first), "the tiny file's")  # (too few tokens to judge)
    mine = transformers.AutoTokenizer.from_pretrained(first)
    mine.add_special_tokens({"additional_special_tokens": ["<mine>"]})
    mine.save_pretrained(tmp_path / "mine")
    assert main(["convert", "--gguf", str(tmp_path / "tiny.gguf"), "--out", str(tmp_path / "second"),
                 "--tokenizer", str(tmp_path / "mine")]) == 0
    assert "<mine>" in transformers.AutoTokenizer.from_pretrained(tmp_path / "second").get_vocab()
    assert main(["convert", "--gguf", str(tmp_path / "tiny.gguf"), "--out", str(tmp_path / "third"),
                 "--tokenizer", str(tmp_path / "nowhere")]) != 0
    assert not (tmp_path / "third").exists()
