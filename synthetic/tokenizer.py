"""A small byte-level BPE tokenizer trained on a built-in corpus, saved as mlx-lm loads it."""

import json
import pathlib

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = [
    "hello world, this is a tiny synthetic model for testing streaming.",
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route each token to a few experts.",
    "for i in range(10):\n    print('hello world', i)\n",
    "user: what is the capital of France?\nassistant: Paris.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols !@#$%^&*()",
]
# Trained vocab cap: a few merges, so prompts stay many tokens long.
_MAX_TOKENIZER_VOCAB = 300


def build_tokenizer(path, vocab_size: int) -> None:
    """Write a small byte-level BPE tokenizer with ids < ``vocab_size``."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    min_vocab = len(alphabet) + len(_SPECIALS)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be >= {min_vocab}, got {vocab_size}")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, _MAX_TOKENIZER_VOCAB),
        special_tokens=_SPECIALS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    special = {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": _CHAT_TEMPLATE,
    }
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    with open(path / "special_tokens_map.json", "w") as f:
        json.dump(special, f, indent=2)
