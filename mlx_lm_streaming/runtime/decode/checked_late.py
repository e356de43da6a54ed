"""Decode with each token's check one token late: t+1 built on t's sample, then t checked.

mlx-lm's ``generate_step`` builds token t+1's graph while token t computes (``async_eval``): the
host's work of a step hides behind the device's. A verified step (verified_step.py) reads its miss
counts back before it returns, so t+1's graph could be built only once t had computed: with every
used expert resident, decode ran at 0.69-0.74 of stock on the H200 (issue 46). Here the decode
loop asks the runner to hold each verified step (``StepRunner.defer``): its forward is sampled and
t+1's graph built on that sample before the host waits for t's counts. Then:

- t found nothing missing: its token is yielded (every token a user sees is a checked one);
- t missed: t+1 was built on a sample of wrong logits. It is let finish (no pending work may read a
  slot that t's reads write), its cache entries are taken back (``mlx_shims.rewind`` to the marks
  taken before it: KV entries trimmed, a hybrid's recurrent state given back its arrays), the
  random state is given back as it was before t's draw (``mx.random.state``) and the tokens the
  logits processors see as they were; t runs again from the layer that missed (``StepRunner.
  redo``), is sampled again, and t+1 is built again on the new sample. So the draws, and the text,
  are stock's, greedy or sampled.

The prompt and the first token's step are stock's own code (``generate_step`` with ``max_tokens=0``,
its progress callback and sampler wrapped): the step is held as every later one (the callback's
call for the prompt's last chunk sets ``defer``), and the first token's draw, made by the wrapped
sampler, ends stock's run there (``_FirstToken``), before stock would wait for that token, so the
second token is built before the first is checked; the callback's last call, stock's after the
first token, is made by the loop. The decode loop after it does what stock's does
(``mlx_compat.DECODE_LOOP_BODY``, checked against the installed mlx-lm). When the
generator is closed with a step still held, or ended by an error (a logits processor's or the
sampler's, or the caller's thrown in where it waits), the steps still held are checked in turn and
the first that missed is run again, what was built on it taken back (``_settle``), so a prompt
cache kept by the caller (the server's, chat's) holds stock's entries: all of them, or all but
those of a step whose draw raised after the token before it missed (its input was that token's
wrong sample).

The check of t (its wait for t's ids, and on a hit the policies' records of its uses) runs on the
runner's own thread (``StepRunner.check_soon``, ``CacheTuning.check_on_thread``), started before
t+1 is built: MLX's evaluation lets the interpreter go while it launches t+1's kernels, most of a
decode step's host time on a GPU, and the check's Python runs then. The answer is taken where the
check ran before, so the order of everything the decode loop does is unchanged.

Where it does not apply, stock's loop runs as before (each verified step checked in its own call):
a sampler or logits processor that keeps state of its own (a dropped token's draw could not be
given back; mlx-lm's own, from ``mlx_lm.sample_utils``, keep none, and a caller's may say how to
take draws back with ``take_back(n)``), KV quantization (``kv_bits``: its caches change class
between steps), input embeddings, caches that cannot be taken back by two tokens, and verified
steps off (``CacheTuning.checked_late`` None, ``verified_steps``). A call that would not be held (every
bank complete, the per-layer mode chosen) first checks the token before it, as before.
"""

import functools
from threading import get_ident
from typing import Optional

import mlx.core as mx

from .. import mlx_compat, mlx_shims

STOCK_SAMPLING = "mlx_lm.sample_utils"


class Token:
    """One decode step's token: its sample and log-probabilities (lazy), the verified step held
    unchecked for it (None: checked), and what taking it back restores."""

    __slots__ = ("y", "logprobs", "held", "key", "tokens", "input", "marks")

    def __init__(self, y, logprobs, held=None, key=None, tokens=None, input=None, marks=None):
        self.y, self.logprobs, self.held = y, logprobs, held
        self.key = key  # mx.random.state[0] before its draw
        self.tokens = tokens  # the tokens the logits processors had seen before its step
        self.input = input  # the token its step ran on
        self.marks = marks  # the prompt cache's entries before its step (``mlx_shims.marks``)


def problem(stock, a, state) -> Optional[str]:
    """None if a call of mlx-lm's ``generate_step`` (``stock``) with arguments ``a`` over the
    streaming model of ``state`` may decode with checks one token late (module docstring), else
    why not."""
    runner = state.steps
    tuning = state.cache.tuning
    if runner is None or tuning.checked_late is None or not tuning.verified_steps:
        return "verified steps or late checks are off"
    if a["kv_bits"] is not None:
        return "a quantized KV cache"
    if a["input_embeddings"] is not None:
        return "input embeddings"
    if a["max_tokens"] == 0:
        return "no tokens"
    if not all(map(_repeatable, [a["sampler"], *(a["logits_processors"] or [])])):
        return "a sampler or logits processor that keeps state of its own"
    return _loop_problem(stock)


def _repeatable(f) -> bool:
    """Whether calling ``f`` (a sampler or logits processor; None: greedy) again for a token gives
    what its first call gave once ``mx.random.state`` is put back: mlx-lm's own, or one that can
    take its last draws back (``take_back``)."""
    return (
        f is None
        or getattr(f, "__module__", None) == STOCK_SAMPLING
        or callable(getattr(f, "take_back", None))
    )


@functools.lru_cache(maxsize=None)
def _loop_problem(generate_step) -> Optional[str]:
    """``mlx_compat.decode_loop_problem``, read once per ``generate_step`` (it reads the source)."""
    return mlx_compat.decode_loop_problem(generate_step)


def generate(stock, a):
    """``generate_step``'s tokens for the bound arguments ``a`` (a mapping, changed here), its
    steps held and checked one token late (module docstring)."""
    from mlx_lm.sample_utils import greedy_sampler

    model, kv = a["model"], a["prompt_cache"]
    if kv is None:
        kv = a["prompt_cache"] = mlx_shims.make_prompt_cache(model, max_kv_size=a["max_kv_size"])
    runner = model.expert_streaming.steps
    sampler = a["sampler"] or greedy_sampler
    processors = list(a["logits_processors"] or [])
    max_tokens, stream = a["max_tokens"], a["stream"]

    # the prompt and the first token's step: stock's code up to the first token's draw, made here
    # (``_FirstToken`` then ends stock's run before it waits for that token): the step held where
    # it may be, as every later one, so that the second token is built before the first is checked
    first = {}
    progress = a["prompt_progress_callback"] or (lambda *_: None)

    def before_first(done, total):
        progress(done, total)
        first["total"] = total
        if done == total - 1:  # (stock's next model call is the first token's step)
            runner.defer = get_ident() if runner.defers(kv) else None

    def first_sampler(logprobs):
        runner.defer = None
        held, key, toks = runner.take_held(), mx.random.state[0], first.get("tokens")
        before = toks[:-1] if toks is not None and toks.size > 1 else None
        last = toks[-1:] if toks is not None else None
        try:
            y, logprobs = sampler(logprobs), logprobs.squeeze(0)
        except BaseException:  # (the prompt cache left as stock's: its step checked first)
            _settle(runner, kv, [Token(None, None, held)])
            raise
        first["token"] = Token(y, logprobs, held, key, before, last)
        mx.async_eval(y, logprobs, *(held.arrays() if held is not None else ()))
        raise _FirstToken

    def seen(processor):
        def process(toks, logits):
            first["tokens"] = toks
            return processor(toks, logits)

        return process

    a["max_tokens"], a["sampler"], a["prompt_progress_callback"] = 0, first_sampler, before_first
    a["logits_processors"] = [seen(p) for p in processors] or None
    try:
        for _ in stock(**a):  # (yields nothing: its first draw raises)
            pass
    except _FirstToken:
        pass
    finally:
        runner.defer = None
    tokens = first.get("tokens")

    def step(prev: Token, hold: bool, soon=None) -> Token:
        """The step on ``prev``'s sample; ``hold``: its verified step held unchecked (where the
        call is one); ``soon``: ``prev``'s check, started."""
        nonlocal tokens
        # (marks only where it may be taken back: the token before it is held only if this one
        # is, and then the caches can be taken back, ``StepRunner.defers``)
        key, before, marks = mx.random.state[0], tokens, mlx_shims.marks(kv) if hold else None
        runner.defer = get_ident() if hold else None
        try:
            logits = model(prev.y[None], cache=kv)
        finally:
            runner.defer = None
        held = runner.take_held()
        try:
            logits, tokens = _processed(logits[:, -1, :], processors, tokens, prev.y)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            y = sampler(logprobs)
        except BaseException:  # (a processor's or the draw's: the prompt cache left stock's)
            _settle(runner, kv, [prev, Token(None, None, held, marks=marks)], soon)
            raise
        token = Token(y, logprobs.squeeze(0), held, key, before, prev.y, marks)
        mx.async_eval(token.y, token.logprobs, *(held.arrays() if held is not None else ()))
        return token

    def checked(t: Token, after: Optional[Token], soon=None) -> Token:
        """``t`` checked (``soon``: its check started on the runner's thread): itself if nothing
        was missing; else ``after`` (built on ``t``'s sample) taken back and ``t`` run again and
        sampled again."""
        nonlocal tokens
        if runner.check(t.held, soon):
            t.held = None
            return t
        if after is not None:  # no pending work may read a slot that t's reads write
            mx.eval(after.y, after.logprobs)
            _take_back(kv, after)
            after.held = None  # (dropped: never checked)
            runner.dropped += 1
        draws = 1 + (after is not None)
        for f in (sampler, *processors):
            if callable(getattr(f, "take_back", None)):
                f.take_back(draws)
        _put_back_key(t.key)
        logits, t.held = runner.redo(t.held), None
        logits, tokens = _processed(logits[:, -1, :], processors, t.tokens, t.input)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return Token(sampler(logprobs), logprobs.squeeze(0))

    current = first["token"]
    after = None
    n = 0
    with mx.stream(stream):
        try:
            while True:
                after = soon = None
                if n != max_tokens:
                    hold = runner.defers(kv)
                    if current.held is not None and not hold:
                        current = checked(current, None)  # the next call checks in its own
                        hold = runner.defers(kv)
                    if current.held is not None:  # (its wait and host work: while t+1 launches)
                        soon = runner.check_soon(current.held)
                    after = step(current, hold, soon)
                if current.held is not None:
                    redone, soon = checked(current, after, soon), None
                    if redone is not current:  # t missed: t+1 was taken back, built again
                        current = redone
                        after = step(current, runner.defers(kv)) if after is not None else None
                if n == max_tokens:
                    break
                if n == 0:  # (stock's, once its first token is computed)
                    progress(first["total"], first["total"])
                yield current.y.item(), current.logprobs
                if n % 256 == 0:
                    mx.clear_cache()
                current = after
                n += 1
        except GeneratorExit:
            pass
        except BaseException:  # (raised by the caller at a yield, or by its progress callback)
            if current.held is None:  # (else the check's own error: nothing more is settled)
                _settle(runner, kv, [after])
            raise
        # a step still held: checked, and run again if it missed, so that the prompt cache
        # holds stock's entries
        _settle(runner, kv, [current, after])


class _FirstToken(Exception):
    """Raised by the first token's draw to end stock's ``generate_step`` there."""


def _settle(runner, kv, chain: list, soon=None) -> None:
    """The held steps of ``chain`` (a token, then the one built on its sample; None: none)
    checked in turn (``soon``: the first one's check, started), and the first that missed run
    again, what came after it taken back and dropped: the prompt cache keeps only checked entries
    (a generation that ends early, closed or by an error)."""
    for i, t in enumerate(chain):
        if t is None or t.held is None:
            continue
        held, t.held = t.held, None
        if runner.check(held, soon if i == 0 else None):
            continue
        mx.synchronize()  # (no launched work may read a slot that its reads write)
        for later in chain[i + 1 :]:
            if later is not None and later.marks is not None:
                _take_back(kv, later)
                later.held = None
                break
        runner.redo(held)
        return


def _take_back(kv, token: Token) -> None:
    """The prompt cache's entries as they were before ``token``'s step."""
    mlx_shims.rewind(kv, token.marks)


def _processed(logits, processors, tokens, y):
    """``logits`` through the logits processors as stock's step does, with ``y`` added to the
    tokens they see; ``(logits, tokens)``."""
    if processors and len(y) > 0:
        tokens = mx.concat([tokens, y]) if tokens is not None else y
        for processor in processors:
            logits = processor(tokens, logits)
    return logits, tokens


def _put_back_key(key: mx.array) -> None:
    """MLX's global random key set to ``key`` (a key ``mx.random.state`` held): the state cannot
    be assigned (mlx 0.32), but ``seed(n)`` sets the key ``[n >> 32, n & 0xffffffff]``."""
    hi, lo = key.tolist()
    mx.random.seed((hi << 32) | lo)
