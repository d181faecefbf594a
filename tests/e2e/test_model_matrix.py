"""The model matrix (tests/matrix.py): every family, float / 4-bit / 8-bit weights.

For each cell the matrix claims: greedy tokens == mlx-lm's generate_step alone and in a
batch of unequal prompts (CPU float32, exact up to proven near-ties); seeded rows alone ==
batched; the prefix cache (RAM, then SSD after a restart) giving identical continuations
where the layers allow it and a warning naming the layers where not; TurboQuant on the
full-attention layers; lookup speculation identical to plain; a one-line refusal at start
for what is not served. docs/supported-models.md must equal the matrix's table.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from tests import matrix
from tests.e2e.reference import PROMPTS, classify, reference
from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Done, Token
from tqserve.engine.config import Config
from tqserve.engine.model import load_model
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 10
NUM_PROMPTS = 5
REUSE_PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
_LOADED: dict[str, object] = {}


@pytest.fixture(scope="session")
def matrix_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("matrix")


def loaded_model(matrix_dir: Path, family: str, weights: str = "float"):
    key = f"{family}-{weights}"
    if key not in _LOADED:
        # quantized weights stay packed (the default on the CPU dequantizes them at load:
        # tests/e2e/test_gguf.py and tools/bench_quant cover that path)
        _LOADED[key] = load_model(matrix.build(matrix_dir, family, weights), "float32",
                                  quantized_weights="keep")
    return _LOADED[key]


async def generate(engine, prompt: str | list[int], **params) -> tuple[list[int], Done]:
    """Greedy (unless params say otherwise) tokens of a prompt given as text or ids."""
    source = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_tokens": prompt}
    request = GenerateRequest(**source, params=SamplingParams(
        max_tokens=params.pop("max_tokens", MAX_TOKENS), **{"temperature": 0.0, **params}))
    tokens, done = [], None
    async for event in engine.generate(request):
        if isinstance(event, Token):
            tokens.append(event.token_id)
        elif isinstance(event, Done):
            done = event
    assert done is not None and done.finish_reason in ("length", "stop"), done
    return tokens, done


async def alone_and_batched(engine, prompts: list[str], **params) -> tuple[list, list]:
    alone = [(await generate(engine, p, **params))[0] for p in prompts]
    batched: list = [None] * len(prompts)

    async def one(k: int) -> None:
        batched[k] = (await generate(engine, prompts[k], **params))[0]

    async with trio.open_nursery() as nursery:
        for k in range(len(prompts)):
            nursery.start_soon(one, k)
    return alone, batched


@pytest.mark.parametrize("weights", matrix.WEIGHTS)
@pytest.mark.parametrize("family", list(matrix.FAMILIES))
async def test_greedy_equals_mlx_lm_alone_and_batched(matrix_dir, family, weights):
    loaded = loaded_model(matrix_dir, family, weights)
    prompts = PROMPTS[:NUM_PROMPTS]
    references = [reference(loaded, p, MAX_TOKENS) for p in prompts]
    config = Config(max_batch=NUM_PROMPTS, prefill_chunk=16, warmup="off", prefix_cache=False)
    async with open_engine(config, loaded=loaded) as engine:
        alone, batched = await alone_and_batched(engine, prompts)
        assert engine.statistics().rows_active == 0
    outcomes = [classify(got, want, gaps) for got, (want, gaps, _) in zip(alone, references)]
    outcomes += [classify(got, want, gaps) for got, (want, gaps, _) in zip(batched, references)]
    assert outcomes.count("near_tie") <= 1, outcomes


@pytest.mark.parametrize("family", list(matrix.FAMILIES))
async def test_seeded_rows_alone_equal_batched(matrix_dir, family):
    loaded = loaded_model(matrix_dir, family)
    prompts = PROMPTS[:4]
    config = Config(max_batch=4, prefill_chunk=16, warmup="off", prefix_cache=False)
    async with open_engine(config, loaded=loaded) as engine:
        alone, batched = await alone_and_batched(engine, prompts, temperature=1.0, seed=11)
    assert alone == batched
    assert len({tuple(t) for t in alone}) > 1  # the rows really sampled different text


@pytest.mark.parametrize("family", list(matrix.FAMILIES))
async def test_prefix_cache_reuses_or_says_why_not(matrix_dir, family, tmp_path, caplog):
    loaded = loaded_model(matrix_dir, family)
    config = Config(max_batch=2, warmup="off", cache_dir=str(tmp_path), ssd_flush="sync")
    reusable = matrix.claims(family)[0] in ("yes", "exact boundaries")
    with caplog.at_level(logging.WARNING, logger="tqserve"):
        async with open_engine(config, loaded=loaded) as engine:
            cold, first = await generate(engine, REUSE_PROMPT)
            warm, second = await generate(engine, REUSE_PROMPT)
        async with open_engine(config, loaded=loaded) as engine:
            restarted, third = await generate(engine, REUSE_PROMPT)
    assert cold == warm == restarted
    assert first.cached_tokens == 0
    if reusable:
        assert second.cached_tokens_by_tier["ram"] > 0, second
        assert third.cached_tokens_by_tier["ssd"] > 0, third
    else:
        assert second.cached_tokens == third.cached_tokens == 0
        off = [r.getMessage() for r in caplog.records if "prefix cache off" in r.getMessage()]
        assert len(off) == 2 and ("RotatingKVCache" in off[0] or "ArraysCache" in off[0]), off


@pytest.mark.parametrize("family", list(matrix.FAMILIES))
async def test_turboquant_on_full_attention_layers(matrix_dir, family, caplog):
    loaded = loaded_model(matrix_dir, family)
    claim = matrix.claims(family)[1]
    config = Config(max_batch=2, warmup="off", prefix_cache=False, turboquant="k4v4")
    if family in matrix.TURBOQUANT_REFUSED:
        with pytest.raises(ValueError, match=matrix.TURBOQUANT_REFUSED[family]):
            async with open_engine(config, loaded=loaded):
                pass
        return
    with caplog.at_level(logging.WARNING, logger="tqserve"):
        async with open_engine(config, loaded=loaded) as engine:
            tokens, _ = await generate(engine, PROMPTS[2])
            stats = engine.statistics()
    assert len(tokens) == MAX_TOKENS and stats.rows_active == 0
    plain = [r.getMessage() for r in caplog.records if "keep plain" in r.getMessage()]
    assert len(plain) == (0 if claim == "yes" else 1), plain
    if claim != "yes":  # sliding, recurrent: the layers left plain are named, once
        assert "RotatingKVCache" in plain[0] or "ArraysCache" in plain[0], plain


@pytest.mark.parametrize("family", list(matrix.FAMILIES))
async def test_lookup_speculation_identical_or_refused_at_start(matrix_dir, family):
    loaded = loaded_model(matrix_dir, family)
    claim = matrix.claims(family)[2]
    config = Config(max_batch=2, warmup="off", prefix_cache=False, speculative="lookup")
    prompt = REUSE_PROMPT * 2
    if claim == matrix.REFUSED:
        with pytest.raises(ValueError, match="--speculative lookup: .* cannot roll back"):
            async with open_engine(config, loaded=loaded):
                pass
        return
    async with open_engine(Config(max_batch=2, warmup="off", prefix_cache=False),
                           loaded=loaded) as engine:
        plain, _ = await generate(engine, prompt, max_tokens=16)
    async with open_engine(config, loaded=loaded) as engine:
        speculated, done = await generate(engine, prompt, max_tokens=16)
    assert speculated == plain
    assert done.speculative is not None and done.speculative[0] > 0, done


async def test_hybrid_second_turn_reuses_the_first(matrix_dir, tmp_path):
    """qwen3_5 (gated delta-net + full attention): a second turn that extends the first
    (its prompt, its answer, a new message) reuses the whole first turn from RAM and,
    after a restart, from the SSD tier, with the tokens of a cold run."""
    loaded = loaded_model(matrix_dir, "qwen3_5")
    encode = loaded.tokenizer.encode
    turn1 = encode(REUSE_PROMPT)
    async with open_engine(Config(max_batch=2, warmup="off", prefix_cache=False),
                           loaded=loaded) as engine:
        answer, _ = await generate(engine, turn1, max_tokens=12)
        turn2 = turn1 + answer + encode("\n\ndef mul(a, b):\n")
        cold, _ = await generate(engine, turn2, max_tokens=12)
    first_turn = len(turn1) + len(answer)
    ram_only = Config(max_batch=2, warmup="off")
    async with open_engine(ram_only, loaded=loaded) as engine:
        assert (await generate(engine, turn1, max_tokens=12))[0] == answer
        warm, ram = await generate(engine, turn2, max_tokens=12)
    config = Config(max_batch=2, warmup="off", cache_dir=str(tmp_path), ssd_flush="sync")
    async with open_engine(config, loaded=loaded) as engine:
        assert (await generate(engine, turn1, max_tokens=12))[0] == answer
    async with open_engine(config, loaded=loaded) as engine:  # a restart: the SSD tier
        restarted, ssd = await generate(engine, turn2, max_tokens=12)
    assert warm == restarted == cold
    assert ram.cached_tokens_by_tier["ram"] >= 0.95 * first_turn, (ram, first_turn)
    assert ssd.cached_tokens_by_tier["ssd"] >= 0.95 * first_turn, (ssd, first_turn)


def test_docs_table_is_the_matrix():
    text = (REPO / "docs" / "supported-models.md").read_text()
    assert matrix.table() in text, "docs/supported-models.md: paste tests.matrix.table()"


async def test_sliding_window_batch_of_8_decodes_in_one_forward_per_step(matrix_dir):
    """gemma3_text (sliding-window + global layers): 8 rows decode together, one forward
    of batch 8 per step, not one forward per row."""
    loaded = loaded_model(matrix_dir, "gemma3_text")
    model = loaded.model
    shapes: list[tuple[int, int]] = []
    original = type(model)

    class Counting(original):  # type: ignore[misc, valid-type]
        def __call__(self, inputs, *args, **kwargs):
            shapes.append(tuple(inputs.shape))
            return super().__call__(inputs, *args, **kwargs)

    prompts = [p for p in PROMPTS[:8]]
    config = Config(max_batch=8, prefill_chunk=64, warmup="off", prefix_cache=False,
                    fast_decode="off")
    model.__class__ = Counting
    try:
        async with open_engine(config, loaded=loaded) as engine:
            async with trio.open_nursery() as nursery:
                for p in prompts:
                    nursery.start_soon(generate, engine, p)
    finally:
        model.__class__ = original
    decode = [b for b, length in shapes if length == 1]
    assert decode.count(8) >= MAX_TOKENS - 2, shapes
    assert len(decode) <= MAX_TOKENS + 8, shapes  # row by row would be 8 x MAX_TOKENS
