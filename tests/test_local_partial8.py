"""The incremental ``final_answer`` scanner against the whole-buffer scan it replaced.

``_old_partial_answer`` is the former ``partial_answer``, the specification, with one change: a
``\\u`` escape with a sign (``\\u-001``) ends the answer as any malformed escape does (it raised). Fed any
split of any reply, the scanner must give after every piece the value the old scan gave for the
text so far, and ``feed`` must return exactly the delta the stream used to derive from it.
"""

from __future__ import annotations

import json
import random
import re
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentloop.events import StreamDone, TextDelta
from agentloop.messages import user
from agentloop.models.local import AnswerScanner, partial_answer
from tests.test_local_protocol import READ, FakeLlama, model, request, run

_ANSWER_HEAD = re.compile(r'\s*\{\s*"final_answer"\s*:\s*"')
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "/": "/", "\\": "\\", '"': '"'}


def _old_partial_answer(buf: str) -> str | None:
    head = _ANSWER_HEAD.match(buf)
    if head is None:
        return None
    out: list[str] = []
    i = head.end()
    n = len(buf)
    while i < n:
        c = buf[i]
        if c == '"':
            break
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= n:
            break
        e = buf[i + 1]
        if e != "u":
            out.append(_ESCAPES.get(e, e))
            i += 2
            continue
        if i + 6 > n:
            break
        try:
            code = int(buf[i + 2 : i + 6], 16)
        except ValueError:
            break
        if code < 0:  # ("\u-001": int() takes a sign; chr() raised here, ending the generation)
            break
        if 0xD800 <= code < 0xDC00:  # a surrogate pair needs its second half
            if i + 12 > n:
                break
            try:
                low = int(buf[i + 8 : i + 12], 16) if buf[i + 6 : i + 8] == "\\u" else -1
            except ValueError:
                low = -1
            if 0xDC00 <= low < 0xE000:
                out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                i += 12
                continue
            out.append("\ufffd")
            i += 6
            continue
        out.append(chr(code))
        i += 6
    return "".join(out)


def check(reply: str, cuts: list[int]) -> None:
    """Feed ``reply`` cut at ``cuts``; after every piece compare with the old scan and old delta."""
    scanner = AnswerScanner()
    streamed = ""  # what the stream had emitted, as _generate kept it before
    bounds = [*sorted({c for c in cuts if 0 < c < len(reply)}), len(reply)]
    start = 0
    for end in bounds:
        value = _old_partial_answer(reply[:end])
        expected = value[len(streamed) :] if value is not None and value.startswith(streamed) else ""
        assert scanner.feed(reply[start:end]) == expected, (reply, end)
        assert scanner.value == value, (reply, end)
        assert value is None or value.startswith(streamed)  # the old values never shrank
        streamed += expected
        start = end
    assert partial_answer(reply) == _old_partial_answer(reply)  # the whole-buffer entry point, still exported


# ------------------------------------------------------------------ replies to try

_TRICKY = [
    "\\",
    '"',
    "\\u",
    "\\ud83d",
    "\\ude00",
    "\\ud800\\u",
    "\\uDBFF\\uDFFF",
    "\\u00e9",
    "\\u-001",
    "\\u+0_1",
    "\\u 12f",
    "\\u0x1f",
    "\\uzz",
    "\\n",
    "\\q",
    "\\/",
    " ",
    "\t",
    "\u00a0",
    "\u2028",
    "{",
    "}",
    ":",
    "u",
    "d",
    "8",
    "0",
    "a",
    "é",
    "😀",
]
_HEADS = [
    '{"final_answer": "',
    '{"final_answer":"',
    ' \n{ \t"final_answer"\u3000:\u00a0"',
    '{"final_answer" : "',
    '{"final_answer": ',
    '{"final_answer"',
    '{"final_answe": "',
    '{"tool": "x", "arguments": {"final_answer": "a"}}',
    '["final_answer": "',
    "x{",
    "",
]

answers = st.text(st.characters(codec="utf-8"), max_size=40)
tricky = st.lists(st.sampled_from(_TRICKY), max_size=25).map("".join)
bodies = st.one_of(
    answers.map(lambda a: json.dumps(a)[1:]),  # the string's JSON body and closing quote
    answers.map(lambda a: json.dumps(a, ensure_ascii=False)[1:]),
    tricky,
    st.tuples(tricky, answers).map(lambda p: p[0] + json.dumps(p[1])[1:]),
)
replies = st.one_of(
    st.tuples(st.sampled_from(_HEADS), bodies, st.sampled_from(["", "}", ' , "x": 1}', "\\u-0"])).map("".join),
    st.text(st.sampled_from([*'{}":\\ u0d8a_final_answer', "\u00a0"]), max_size=40),
    tricky,
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reply=replies, cuts=st.lists(st.integers(0, 120), max_size=30))
def test_any_split_matches_the_old_scan(reply: str, cuts: list[int]) -> None:
    check(reply, cuts)


def test_every_split_of_adversarial_replies() -> None:
    cases = [
        *(h + "".join(_TRICKY) for h in _HEADS),
        json.dumps({"final_answer": 'line1\n"q" \u00e9 \U0001f600 end\\'}),
        json.dumps({"final_answer": "\U0001f600\ud800x\udc00"}, ensure_ascii=True),
        '{"final_answer": "ab\\ud83d\\ude00\\ud83dxx\\ud83d\\u0041\\uDE00"}',
        '{"final_answer": "\\ud83d\\uzzzz tail"}',
        '{"final_answer": "\\u12"',
        '{"final_answer": "ok \\u-001 never"}',
        "   \n  ",
        '{ "final_answer" :\t"',
    ]
    for reply in cases:
        n = len(reply)
        check(reply, list(range(n + 1)))  # a character at a time
        for i in range(n + 1):  # every two-piece split
            check(reply, [i])
        for j in range(0, n, 5):  # and some three-piece ones
            check(reply, [j, j + 7])
    rng = random.Random(8)
    for _ in range(300):
        reply = rng.choice(_HEADS) + "".join(rng.choices(_TRICKY, k=rng.randrange(30))) + rng.choice(['"}', ""])
        check(reply, [rng.randrange(len(reply) + 1) for _ in range(rng.randrange(12))])


def test_after_the_answer_closes_nothing_more_is_taken() -> None:
    scanner = AnswerScanner()
    assert scanner.feed('{"final_answer": "a') == "a"
    assert scanner.feed('b", "x": "c') == "b"
    assert scanner.feed("more") == "" and scanner.value == "ab"
    scanner = AnswerScanner()
    assert scanner.feed('{"tool": "final_answer"') == "" and scanner.value is None
    assert scanner.feed('"x"') == "" and scanner.value is None


# ------------------------------------------------------------------ cost


def _feed_all(tokens: list[str]) -> tuple[float, str]:
    best = float("inf")
    text = ""
    for _ in range(3):
        scanner = AnswerScanner()
        t0 = time.perf_counter()
        text = "".join([scanner.feed(t) for t in tokens])
        best = min(best, time.perf_counter() - t0)
    return best, text


def test_cost_is_linear_in_the_tokens() -> None:
    unit = 'Some words, a "quote", tab\t, é \U0001f600 and a \\ backslash.\n'

    def tokens(n: int) -> tuple[list[str], str]:
        answer = (unit * (n * 3 // len(unit) + 1))[: n * 3]
        reply = json.dumps({"final_answer": answer})  # escapes: \", \t, \u00e9, \ud83d\ude00, \\, \n
        return [reply[i : i + 3] for i in range(0, len(reply), 3)], answer

    n = 6000
    small, small_answer = tokens(n)
    big, big_answer = tokens(4 * n)
    t_small, text_small = _feed_all(small)
    t_big, text_big = _feed_all(big)
    assert text_small == small_answer and text_big == big_answer
    assert t_big / t_small < 8, (t_small, t_big)  # quadratic would be about 16


async def test_a_long_escaped_answer_streams_whole() -> None:
    answer = " ".join(f'line {i}: say "hi"\\ \u00e9\U0001f600\n' for i in range(300))
    fake = FakeLlama(json.dumps({"final_answer": answer}))
    events, last = await run(model(fake), request(user("talk"), tools=[READ]))
    assert isinstance(last, StreamDone) and last.message.text == answer
    deltas = [e.delta for e in events if isinstance(e, TextDelta)]
    assert len(deltas) > 100 and "".join(deltas) == answer
