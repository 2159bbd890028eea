"""Stop-string matching edges that mutation testing showed no test pinned
(scripts/mutation.sh): a stop at the very start, a stop seen twice, how much text is held back,
and a matcher with no stops or not searching yet."""

from __future__ import annotations

import pytest

from pdserve.router.generation import StopStringMatcher


def test_a_stop_at_the_very_start_leaves_no_text() -> None:
    assert StopStringMatcher(("ab",)).push("abc") == ("", True)


def test_the_first_of_two_occurrences_cuts() -> None:
    assert StopStringMatcher(("bc",)).push("abcabc") == ("a", True)


def test_text_that_cannot_begin_a_stop_is_sent_at_once() -> None:
    matcher = StopStringMatcher(("z",))
    assert matcher.push("ab") == ("ab", False)
    assert matcher.flush() == ""


@pytest.mark.parametrize(
    ("text", "sent", "held"),
    [("xa", "x", "a"), ("xab", "x", "ab"), ("xabc", "x", "abc"), ("abcx", "abcx", "")],
)
def test_exactly_the_tail_that_may_begin_a_stop_is_held(text: str, sent: str, held: str) -> None:
    matcher = StopStringMatcher(("abcd",))
    assert matcher.push(text) == (sent, False)
    assert matcher.flush() == held


def test_a_stop_split_at_its_last_character_is_found() -> None:
    matcher = StopStringMatcher(("abc",))
    assert matcher.push("xab") == ("x", False)
    assert matcher.push("cy") == ("", True)


def test_without_stops_or_search_text_passes_through_whole() -> None:
    for matcher, search in ((StopStringMatcher(()), True), (StopStringMatcher(("b",)), False)):
        assert matcher.push("ab", search) == ("ab", False)
        assert matcher.push("cd", search) == ("cd", False)
        assert matcher.flush() == ""


def test_held_text_is_sent_once_when_search_is_off() -> None:
    matcher = StopStringMatcher(("abc",))
    assert matcher.push("xa") == ("x", False)
    assert matcher.push("b", search=False) == ("ab", False)
    assert matcher.push("c") == ("c", False)  # the stop began in text already sent


def test_flush_empties_the_matcher() -> None:
    matcher = StopStringMatcher(("abc",))
    matcher.push("xab")
    assert matcher.flush() == "ab"
    assert matcher.flush() == ""
    assert matcher.push("z") == ("z", False)
