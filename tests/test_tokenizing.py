"""PieceCache: a chat's messages tokenised once. Its ids must equal the tokenizer's own on every
text (pieces from the cache or not); it turns itself off for tokenizers whose pieces' ids depend
on what precedes them."""
import random

import pytest

pytest.importorskip("tokenizers")
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402,E501
from transformers import PreTrainedTokenizerFast  # noqa: E402

from longspec.serving.tokenizing import PieceCache  # noqa: E402

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, def f(x): return x + 1",
          "  spaces\n\nnewlines\tand tabs é 漢字 it's 12345"] * 40
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_level(lstrip: bool = False, style: str = "gpt2") -> PreTrainedTokenizerFast:
    """A small byte-level BPE with ChatML tokens: GPT-2's pre-tokenizer (SmolLM2), or Llama 3's
    split regex before the byte mapping (``llama3``), or that with Qwen 2's NFC normaliser
    (``qwen2``)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if style != "gpt2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if lstrip:
        tok.add_special_tokens([AddedToken("<mask>", lstrip=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=TEMPLATE)


def metaspace_first() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer that prepends "▁" to the text's start only: a piece after
    an added token gets other ids alone than inside the text."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320,
                                                        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=TEMPLATE)


def random_chat(rng: random.Random, turns: int) -> list:
    words = "the quick brown fox <|im_end|> jumps\n over  the\tlazy dog é 漢字 it's 12345 def f(x):".split(" ")
    return [{"role": ("user", "assistant")[k % 2], "content": " ".join(rng.choices(words, k=rng.randrange(0, 300)))}
            for k in range(turns)]


@pytest.mark.parametrize("style", ["gpt2", "llama3", "qwen2"])
def test_a_growing_chat_gets_the_tokenizers_ids_from_the_cache(style):
    tok = byte_level(style=style)
    cache = PieceCache(tok, min_chars=16)
    assert cache.enabled, cache.reason
    rng = random.Random(0)
    chat = random_chat(rng, 7)
    for turns in range(1, 8, 2):
        text = tok.apply_chat_template(chat[:turns], add_generation_prompt=True, tokenize=False)
        assert cache.encode(text) == tok(text, add_special_tokens=False).input_ids
    stats = cache.stats()
    assert stats["pieces"] > 0 and 0.3 < stats["hit_rate"] < 1  # the earlier turns came from the cache
    for _ in range(30):  # raw texts: added tokens anywhere, spaces and newlines beside them
        text = "".join(rng.choice(["<|im_start|>", "<|im_end|>", " ", "\n", "\r\n", "  x", "fox ", "é", "e\u0301",
                                   "\u0301", "def", "'s", "123456"])
                       for _ in range(rng.randrange(1, 60)))
        assert cache.encode(text) == tok(text, add_special_tokens=False).input_ids, repr(text)
        assert cache.encode(text) == tok(text, add_special_tokens=False).input_ids, repr(text)  # (now cached)


def test_the_cache_holds_at_most_max_bytes_of_texts_and_ids():
    tok = byte_level()
    cache = PieceCache(tok, max_bytes=4000, min_chars=16)
    rng = random.Random(1)
    for _ in range(20):
        text = tok.apply_chat_template(random_chat(rng, 3), tokenize=False)
        assert cache.encode(text) == tok(text, add_special_tokens=False).input_ids
        assert cache.tokens == sum(map(len, cache.pieces.values()))
        assert 0 < cache.bytes <= 4000 and cache.bytes == sum(map(PieceCache._size, *zip(*cache.pieces.items())))


@pytest.mark.parametrize("make, why", [(metaspace_first, "depend on what precedes"),
                                       (lambda: byte_level(lstrip=True), "strips the spaces")])
def test_tokenizers_whose_pieces_depend_on_their_neighbours_are_tokenised_whole(make, why):
    tok = make()
    cache = PieceCache(tok, min_chars=1)
    assert not cache.enabled and why in cache.reason and why in cache.stats()["reason"]
    text = tok.apply_chat_template(random_chat(random.Random(2), 4), tokenize=False)
    assert cache.encode(text) == tok(text, add_special_tokens=False).input_ids
    assert cache.stats()["pieces"] == 0


def test_the_default_models_tokenizer_on_real_text(tmp_path):
    from conftest import needs_default_model

    needs_default_model()
    from pathlib import Path

    from transformers import AutoTokenizer

    from longspec.convert import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    cache = PieceCache(tok)
    assert cache.enabled, cache.reason
    doc = "\n\n".join(p.read_text() for p in sorted(Path(__file__).parent.glob("test_*.py"))[:6])
    chat = [{"role": "user", "content": doc + "\nWhat does this test?"}]
    for turn in range(3):
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert cache.encode(text) == tok(text, add_special_tokens=False).input_ids
        chat += [{"role": "assistant", "content": f" It tests {turn}.\n"}, {"role": "user", "content": "And then?"}]
    assert cache.stats()["hit_rate"] > 0.5
