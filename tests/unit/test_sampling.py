"""Per-row sampling: validation, greedy, seeds independent of the batch, masks, logprobs."""

import math

import mlx.core as mx
import numpy as np
import pytest

from tqserve.engine.sampling import RowSampler, SamplingParams, sample_rows

V = 64


def logits_batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return mx.array(rng.normal(size=(n, V)).astype(np.float32) * 2.0)


def rows(*params):
    return [RowSampler.create(p, prompt=(1, 2, 3)) for p in params]


@pytest.mark.parametrize("field,value,msg", [
    ("temperature", -0.1, "temperature"), ("temperature", "hot", "temperature"),
    ("top_p", 0.0, "top_p"), ("top_p", 1.5, "top_p"), ("top_k", -1, "top_k"),
    ("min_p", 1.5, "min_p"), ("repetition_penalty", 0.0, "repetition_penalty"),
    ("max_tokens", 0, "max_tokens"), ("max_tokens", 1.5, "max_tokens"),
    ("seed", -1, "seed"), ("seed", True, "seed"), ("logprobs", 1, "logprobs"),
    ("top_logprobs", 21, "top_logprobs"), ("stop", ("",), "stop"),
    ("stop_token_ids", (-1,), "stop_token_ids"),
])
def test_params_validation_names_the_field(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**{field: value})


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    logits = logits_batch(3)
    out = sample_rows(logits, rows(*[SamplingParams(temperature=0.0, logprobs=True,
                                                    top_logprobs=5)] * 3))
    ref = np.array(logits)
    assert out.tokens == ref.argmax(-1).tolist()
    lsm = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - ref.max(-1, keepdims=True)
    for i in range(3):
        assert out.logprobs[i] == pytest.approx(lsm[i, out.tokens[i]], abs=1e-5)
        top = out.top_logprobs[i]
        assert [t for t, _ in top] == np.argsort(-lsm[i])[:5].tolist()
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


def test_seeded_row_gives_same_tokens_alone_and_in_any_batch():
    target = logits_batch(1, seed=5)
    others = logits_batch(4, seed=6)
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=20)
    alone = rows(p)
    batched = rows(SamplingParams(temperature=0.7), p, SamplingParams(temperature=0.0),
                   SamplingParams(temperature=1.3, seed=9, top_k=5))
    seq_alone, seq_batched = [], []
    for _ in range(20):
        seq_alone += sample_rows(target, alone).tokens
        mixed = mx.concatenate([others[:1], target, others[1:3]])
        seq_batched.append(sample_rows(mixed, batched).tokens[1])
    assert seq_alone == seq_batched
    assert len(set(seq_alone)) > 1  # really sampling, not greedy


MIXED = [  # seeded rows with every processing step, greedy and penalized rows among them
    SamplingParams(temperature=0.9, seed=11, max_tokens=40),
    SamplingParams(temperature=1.2, seed=12, top_k=6, max_tokens=40),
    SamplingParams(temperature=0.8, seed=13, top_p=0.7, max_tokens=40, logprobs=True),
    SamplingParams(temperature=1.0, seed=14, min_p=0.1, repetition_penalty=1.5, max_tokens=40),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=40, top_logprobs=3),
    SamplingParams(temperature=1.1, seed=2**63 - 1, top_k=10, top_p=0.9, max_tokens=40),
]


def test_mixed_batches_that_change_every_step_give_each_row_its_tokens_alone():
    """Each row's logits are fixed per row; every step a different subset of rows is
    batched, in a different order, and rows join late: each row's tokens equal its tokens
    when it runs alone, step for step."""
    table = logits_batch(len(MIXED), seed=3)
    alone = []
    for i, p in enumerate(MIXED):
        [row] = rows(p)
        alone.append([sample_rows(table[i:i + 1], [row]).tokens[0] for _ in range(12)])
    samplers = rows(*MIXED)
    got: list[list[int]] = [[] for _ in MIXED]
    order = np.random.default_rng(0)
    for step in range(16):
        members = [int(i) for i in order.permutation(len(MIXED))
                   if len(got[i]) < 12 and (i < 3 or step >= i)]  # rows 3.. join late
        if order.random() < 0.3 and len(members) > 1:
            members = members[:-1]  # a row sits this step out
        if not members:
            continue
        out = sample_rows(table[mx.array(members)], [samplers[i] for i in members])
        for i, token in zip(members, out.tokens):
            got[i].append(token)
    for i in range(len(MIXED)):
        assert got[i] == alone[i][:len(got[i])] and len(got[i]) >= 8, i
    assert all(len(set(alone[i])) > 1 for i in (0, 1, 2, 5))  # really sampling


def test_noise_is_a_function_of_seed_and_token_index():
    from tqserve.engine.sampling import gumbel_noise, row_keys

    keys = row_keys([7, 7, 8, 2**63 - 1], [0, 1, 0, 5])
    assert keys.dtype == np.uint32 and keys.shape == (4, 2)
    assert np.array_equal(keys[1], row_keys([7], [1])[0])
    batch = np.array(gumbel_noise(keys, 1000))
    for i in range(4):  # bit-equal alone and in the batch
        assert np.array_equal(batch[i], np.array(gumbel_noise(keys[i:i + 1], 1000))[0])
    assert len({tuple(row[:8]) for row in batch}) == 4  # seeds and indices both matter
    many = np.array(gumbel_noise(row_keys(range(100), range(100)), 2000)).ravel()
    assert abs(many.mean() - 0.5772) < 0.02 and abs(many.std() - 1.2825) < 0.02  # Gumbel
    assert np.isfinite(many).all()


def test_extreme_bits_give_finite_noise_and_masked_tokens_are_never_drawn():
    from tqserve.engine.sampling import open_uniform

    u = np.array(open_uniform(mx.array([0, 1, 2**31, 2**32 - 1], dtype=mx.uint32)))
    assert (u > 0).all() and (u < 1).all()
    assert np.isfinite(-np.log(-np.log(u.astype(np.float64)))).all()
    assert np.isfinite(np.array(-mx.log(-mx.log(mx.array(u))))).all()  # in float32 too
    masks = np.zeros((ROWS, 1), dtype=np.int32)
    masks[:, 0] = 0b1010  # tokens 1 and 3 only
    logits = mx.array(np.tile(DIST_LOGITS.astype(np.float32), (ROWS, 1)))
    batch = [RowSampler.create(SamplingParams(seed=i, temperature=1.5), (1,))
             for i in range(ROWS)]
    for _ in range(4):
        assert set(sample_rows(logits, batch, masks).tokens) <= {1, 3}


def test_different_seeds_differ():
    logits = logits_batch(1)
    a = [sample_rows(logits, r).tokens[0] for r in [rows(SamplingParams(seed=1, max_tokens=30))] * 30]
    b = [sample_rows(logits, r).tokens[0] for r in [rows(SamplingParams(seed=2, max_tokens=30))] * 30]
    assert a != b


def test_sampling_follows_the_softmax_distribution():
    logits = mx.array([[2.0, 1.0, 0.0, -1.0]])
    probs = np.exp([2.0, 1.0, 0.0, -1.0])
    probs /= probs.sum()
    n = 4000
    row = rows(SamplingParams(seed=3, max_tokens=n))
    counts = np.zeros(4)
    for _ in range(n):
        counts[sample_rows(logits, row).tokens[0]] += 1
    chi2 = (((counts - n * probs) ** 2) / (n * probs)).sum()
    assert chi2 < 16.3  # p = 0.001 for 3 degrees of freedom


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = logits_batch(2, seed=11)
    greedy = np.array(logits).argmax(-1).tolist()
    out = sample_rows(logits, rows(SamplingParams(top_k=1, seed=1), SamplingParams(top_p=1e-6, seed=2)))
    assert out.tokens == greedy


def test_top_k_and_min_p_restrict_the_support():
    logits = logits_batch(1, seed=12)
    ref = np.array(logits)[0]
    top3 = set(np.argsort(-ref)[:3].tolist())
    row = rows(SamplingParams(top_k=3, seed=4, max_tokens=200))
    drawn = {sample_rows(logits, row).tokens[0] for _ in range(200)}
    assert drawn <= top3 and len(drawn) > 1
    probs = np.exp(ref - ref.max())
    allowed = set(np.nonzero(probs >= 0.5)[0].tolist())
    row = rows(SamplingParams(min_p=0.5, seed=5, max_tokens=200))
    drawn = {sample_rows(logits, row).tokens[0] for _ in range(200)}
    assert drawn <= allowed


def test_repetition_penalty_pushes_seen_tokens_down():
    logits = mx.array([[3.0, 2.9, -1.0, 0.0]])
    row = RowSampler.create(SamplingParams(temperature=0.0, repetition_penalty=2.0), (0, 7))
    assert sample_rows(logits, [row]).tokens == [1]  # 0 was in the prompt: 1.5 < 2.9
    assert row.seen(4).tolist() == [True, True, False, False]  # 7: outside the vocabulary
    assert sample_rows(logits, [row]).tokens == [0]  # now 1 was seen too: 1.5 > 1.45
    plain = RowSampler.create(SamplingParams(temperature=0.0), (0,))
    both = sample_rows(mx.concatenate([logits, logits]),
                       [RowSampler.create(SamplingParams(temperature=0.0,
                                                         repetition_penalty=2.0), (0,)), plain])
    assert both.tokens == [1, 0]  # the penalty is per row


def test_logprob_is_finite_and_negative():
    out = sample_rows(logits_batch(2), rows(SamplingParams(logprobs=True, seed=1),
                                            SamplingParams(logprobs=False, seed=2)))
    assert out.logprobs[0] <= 0 and math.isfinite(out.logprobs[0])
    assert out.logprobs[1] is None and out.top_logprobs == [None, None]


# ---------------------------------------------- filtered and tempered distributions

DIST_LOGITS = np.array([2.0, 1.6, 1.2, 0.9, 0.5, 0.2, -0.3, -0.8, -1.5, -2.5, -4.0, -6.0])
CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26]
DRAWS_PER_ROW = 8   # one row draws this many tokens (its keys), ...
ROWS = 500          # ... and this many seeded rows share one batched call: 4000 draws


def exact_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The engine's documented sampling distribution, computed here in float64: temper,
    then keep the top_k largest, then the smallest prefix (by probability) whose mass
    before each kept token is < top_p, then tokens with probability >= min_p * the
    largest; renormalize after each step."""
    z = logits / temperature
    keep = np.ones(len(z), bool)
    if top_k:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        keep[order[before >= top_p]] = False
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if min_p > 0.0:
        keep &= p >= min_p * p.max()
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def draw_counts(params_kw, seed_base):
    logits = mx.array(np.tile(DIST_LOGITS.astype(np.float32), (ROWS, 1)))
    batch = [RowSampler.create(SamplingParams(max_tokens=DRAWS_PER_ROW, seed=seed_base + i,
                                              **params_kw), prompt=(1,)) for i in range(ROWS)]
    counts = np.zeros(len(DIST_LOGITS))
    for _ in range(DRAWS_PER_ROW):
        for token in sample_rows(logits, batch).tokens:
            counts[token] += 1
    return counts


@pytest.mark.parametrize("params_kw", [
    dict(temperature=0.7),
    dict(temperature=0.7, top_p=0.8),
    dict(temperature=1.3, top_k=4),
    dict(temperature=0.7, min_p=0.1),
    dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sampling_follows_the_exact_filtered_tempered_distribution(params_kw):
    probs = exact_distribution(DIST_LOGITS, **params_kw)
    counts = draw_counts(params_kw, seed_base=1000)
    n = counts.sum()
    assert n == ROWS * DRAWS_PER_ROW
    assert counts[probs == 0].sum() == 0, (counts, probs)  # nothing outside the support
    expected = n * probs
    big = expected >= 5  # bins expecting fewer than 5 draws are pooled into one
    observed = list(counts[big]) + ([counts[~big & (probs > 0)].sum()]
                                    if (~big & (probs > 0)).any() else [])
    wanted = list(expected[big]) + ([expected[~big & (probs > 0)].sum()]
                                    if (~big & (probs > 0)).any() else [])
    observed, wanted = np.array(observed), np.array(wanted)
    assert len(wanted) >= 2
    chi2 = (((observed - wanted) ** 2) / wanted).sum()
    assert chi2 < CHI2_999[len(wanted) - 2], (chi2, observed, wanted)  # p = 0.001
    # the test can tell: the same draws against the untempered, unfiltered softmax fail
    plain = exact_distribution(DIST_LOGITS)
    assert (((counts - n * plain) ** 2) / (n * plain)).sum() > CHI2_999[len(plain) - 2]
