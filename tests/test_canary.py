"""The canary's own limits and its verdicts: a hung server fails it within canary_timeout_s
(not request_timeout_s), a systematic problem fails it, a sporadic one is a warning.

Servers (tests/fake_servers.py): `FakeServer`, and `silent_server`, a socket that accepts
connections and never writes a byte.
"""

from __future__ import annotations

import threading

import pytest

from eaglet.canary import PARSER_HINT, CanaryError, canary_limits, run_canary, systematic
from eaglet.errors import is_transient
from tests.engine_helpers import TOKENIZER, engine_for, make_config, make_prompt
from tests.fake_servers import EOS_ID, FakeServer, serve, silent_server

PROMPTS = [make_prompt(i) for i in range(4)]


def canary_in_thread(*args, **kwargs):
    """run_canary in a thread; None if it has not returned after a minute (a hang)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(run_canary(*args, **kwargs)))
    thread.daemon = True
    thread.start()
    thread.join(timeout=60)
    return result[0] if result else None


def test_canary_limits_cap_tokens_and_time_below_the_run_settings():
    config = make_config(["http://x"], max_tokens=8192, request_timeout_s=1800)
    assert canary_limits(config) == (512, 45.0)
    small = make_config(["http://x"], max_tokens=100, request_timeout_s=5)
    assert canary_limits(small) == (100, 5.0)


def test_canary_requests_use_the_canary_max_tokens(server_fresh):
    fake, url = server_fresh
    config = make_config([url], max_tokens=4096, canary_max_tokens=200, canary_requests=2)
    report = run_canary(config, TOKENIZER, PROMPTS, engine_for(config))
    assert report.ok, report.render()
    assert {entry["body"]["max_tokens"] for entry in fake.log} == {200}


def test_server_that_accepts_and_never_answers_fails_within_the_canary_budget():
    with silent_server() as url:
        config = make_config([url], request_timeout_s=1800, canary_timeout_s=2)
        report = canary_in_thread(config, TOKENIZER, PROMPTS, engine_for(config))
    assert report is not None, "the canary hung past a minute with canary_timeout_s=2"
    assert not report.ok
    assert "did not answer GET" in report.failures[0]
    assert "generation.endpoints" in report.failures[0]
    with pytest.raises(CanaryError) as raised:  # no answer to show: no `eaglet doctor` hint
        report.raise_if_failed()
    assert not is_transient(raised.value)  # never retried, and the advice says Retry fails too
    assert "eaglet doctor" not in str(raised.value)


def test_server_that_lists_models_but_never_generates_fails_within_the_canary_budget():
    fake = FakeServer(TOKENIZER, hang_s=600)
    fake.faults.extend(["hang"] * 8)
    with serve(fake) as url:
        config = make_config([url], request_timeout_s=1800, canary_timeout_s=1.5)
        report = canary_in_thread(config, TOKENIZER, PROMPTS, engine_for(config))
    assert report is not None, "the canary hung past a minute with canary_timeout_s=1.5"
    assert not report.ok
    assert "no answer within generation.canary_timeout_s=1.5 s" in report.failures[0]
    assert "raise generation.canary_timeout_s" in report.failures[0]
    with pytest.raises(CanaryError) as raised:  # it answers, so a setting must change
        report.raise_if_failed()
    assert "eaglet doctor" in str(raised.value)


def test_answers_cut_at_the_canary_limit_are_a_warning_not_a_failure(server_fresh):
    fake, url = server_fresh
    config = make_config([url], max_tokens=4096, canary_max_tokens=16)
    report = run_canary(config, TOKENIZER, PROMPTS, engine_for(config))
    assert report.ok, report.render()
    assert any("generation.canary_max_tokens=16" in w for w in report.warnings)


def test_systematic_means_more_than_half_of_the_answers_judged():
    assert not systematic(1, 4) and not systematic(2, 4)
    assert systematic(3, 4) and systematic(1, 1) and not systematic(0, 0)


class SomeUnclosed(FakeServer):
    """Answers to the first `unclosed` distinct prompts never close their reasoning."""

    def __init__(self, unclosed: int, **kwargs) -> None:
        super().__init__(TOKENIZER, **kwargs)
        self.unclosed = unclosed
        self.seen: list[tuple[int, ...]] = []

    def complete(self, prompt_ids, max_tokens):
        key = tuple(prompt_ids)
        if key not in self.seen:
            self.seen.append(key)
        if self.seen.index(key) < self.unclosed:
            return TOKENIZER.encode("thinking on and on") + [EOS_ID], "stop"
        return super().complete(prompt_ids, max_tokens)


def test_one_of_four_answers_unclosed_is_a_warning():
    with serve(SomeUnclosed(1)) as url:
        config = make_config([url])
        report = run_canary(config, TOKENIZER, PROMPTS, engine_for(config))
    assert report.ok, report.render()
    assert any("1 of 4 finished answers have no closing" in w for w in report.warnings)
    assert any("reasoning.min_capture_rate" in w for w in report.warnings)


def test_most_answers_unclosed_fails():
    with serve(SomeUnclosed(3)) as url:
        config = make_config([url])
        report = run_canary(config, TOKENIZER, PROMPTS, engine_for(config))
    assert not report.ok
    assert "3 of 4 finished answers have no closing </think>" in report.failures[0]
    assert "tokenize.chat_template_kwargs" in report.failures[0]


class SomeLeaked(FakeServer):
    """An openai-style server whose reasoning parser misses the first `leaked` prompts: their
    thinking stays in `content`, tags and all."""

    def __init__(self, leaked: int) -> None:
        super().__init__(TOKENIZER)
        self.leaked = leaked
        self.count = 0

    def _chat(self, request, abort):
        answer = super()._chat(request, abort)
        self.count += 1
        if self.count <= self.leaked:
            message = answer["choices"][0]["message"]
            message["content"] = f"{message.pop('reasoning')}</think>{message['content']}"
        return answer


@pytest.mark.parametrize(("leaked", "fails"), [(1, False), (4, True)])
def test_thinking_in_content_fails_only_when_systematic(leaked, fails):
    with serve(SomeLeaked(leaked)) as url:
        config = make_config([url], "openai", concurrency=1)
        report = run_canary(config, TOKENIZER, PROMPTS, engine_for(config))
    if fails:
        assert not report.ok and PARSER_HINT in report.failures[0]
    else:
        assert report.ok, report.render()
        assert any("thinking text in `content`" in w for w in report.warnings)


def test_wrong_template_kwargs_show_as_systematic_prompt_id_mismatch():
    """The server renders the template with other kwargs than the tokenize stage did: every
    answer reports other prompt ids."""

    class OtherTemplate(FakeServer):
        def _chat(self, request, abort):
            answer = super()._chat(request, abort)
            answer["prompt_token_ids"] = [*answer["prompt_token_ids"], 7]
            return answer

    with serve(OtherTemplate(TOKENIZER)) as url:
        config = make_config([url], "openai")
        report = run_canary(config, TOKENIZER, PROMPTS, engine_for(config))
    assert not report.ok
    assert "4 of 4 answers: the server saw other prompt token ids" in report.failures[0]
    assert "chat_template_kwargs" in report.failures[0]


def test_no_token_ids_fails_unless_text_only_is_accepted():
    fake = FakeServer(TOKENIZER, chat_token_ids=False)
    with serve(fake) as url:
        config = make_config([url], "openai")
        report = run_canary(config, TOKENIZER, PROMPTS, engine_for(config))
        assert not report.ok
        assert "4 of 4 answers came without token ids" in report.failures[0]
        assert "generation.canary_accept_text_only=true" in report.failures[0]
        config = make_config([url], "openai", canary_accept_text_only=True)
        report = run_canary(config, TOKENIZER, PROMPTS, engine_for(config))
    assert report.ok, report.render()
    assert any("without token ids" in w for w in report.warnings)


def test_one_refused_prompt_is_a_warning_most_refused_fail(server_fresh):
    fake, url = server_fresh
    fake.faults.append("400")
    config = make_config([url], concurrency=1)
    report = run_canary(config, TOKENIZER, PROMPTS, engine_for(config))
    assert report.ok, report.render()
    assert any("HTTP 400" in w for w in report.warnings)
    fake.faults.extend(["400"] * 4)
    report = run_canary(config, TOKENIZER, PROMPTS, engine_for(config))
    assert not report.ok and "HTTP 400" in report.failures[0]


@pytest.fixture
def server_fresh():
    fake = FakeServer(TOKENIZER)
    with serve(fake) as url:
        yield fake, url


class TokenZeroForever(FakeServer):
    """A degenerate target: token 0 until the limit, every prompt."""

    def complete(self, prompt_ids, max_tokens):
        return [0] * max_tokens, "length"


def test_answers_the_loop_guard_stopped_are_not_told_to_raise_max_tokens():
    """Issue 40: a server whose every answer the loop guard stopped (at 36 tokens), and a target
    that emits token 0 forever, were told to "raise generation.max_tokens". A longer limit
    cannot help either: the failure says the target repeats itself and what to check."""
    with serve(FakeServer(TOKENIZER, loop_share=1.0)) as url:
        config = make_config([url], max_tokens=4096)  # the guard at its defaults
        report = run_canary(config, TOKENIZER, PROMPTS, engine_for(config))
    assert not report.ok
    [failure] = report.failures
    assert "stopped by the loop guard (finish_reason loop" in failure, failure
    assert "will not help" in failure and "raise generation.max_tokens" not in failure
    assert "loop_ngram=32, loop_repeats=8" in failure  # what stopped them, named
    assert not any("hit generation" in w for w in report.warnings), report.warnings

    # Issue 46: a guard tighter than ordinary text (2 x 2) stopped every answer: its own
    # settings are named first, and the target is not blamed
    with serve(FakeServer(TOKENIZER, loop_share=1.0)) as url:
        config = make_config([url], max_tokens=4096, loop_ngram=2, loop_repeats=2)
        report = run_canary(config, TOKENIZER, PROMPTS, engine_for(config))
    [failure] = report.failures
    assert "loop guard's own settings (generation.loop_ngram=2, loop_repeats=2" in failure
    assert "repeats itself" not in failure, failure
    assert not any("hit generation" in w for w in report.warnings), report.warnings

    with serve(TokenZeroForever(TOKENIZER)) as url:
        config = make_config([url], max_tokens=64, loop_guard=False)
        report = run_canary(config, TOKENIZER, PROMPTS, engine_for(config))
    assert not report.ok
    [failure] = report.failures
    assert "end in token 0" in failure and "over and over" in failure, failure
    assert "raise generation.max_tokens" not in failure
