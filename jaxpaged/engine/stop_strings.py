"""Stop strings found in time proportional to the new text, whatever the number of strings.

An Aho-Corasick automaton (Aho and Corasick, "Efficient string matching", CACM 1975) over a
request's stop strings is built once, with its `SamplingParams`. Each completion keeps one state
of it (`StopStringState`) and feeds it each detokenized delta, character by character: the state
is the longest suffix of the text so far that begins some stop string, so a completed stop string
and the text to hold back from a stream (a suffix that may still become a stop string) are both
read off the state, without rescanning the text or looping over the strings.
"""

from __future__ import annotations

from collections import deque


class StopStrings:
    """The automaton over `stops`: node 0 is the empty string, node i a prefix of some stop.

    Per node: `_next` its trie edges, `_fail` the node of its longest proper suffix that is also
    a node, `_match` the length of the longest stop string ending it (0: none), and `_hold` the
    length of its longest suffix that is a proper prefix of some stop string (text that a stream
    holds back).
    """

    def __init__(self, stops: list[str]):
        self._next: list[dict[str, int]] = [{}]
        self._depth, self._match = [0], [0]
        for stop in stops:
            node = 0
            for ch in stop:
                if ch not in self._next[node]:
                    self._next.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._match.append(0)
                    self._next[node][ch] = len(self._next) - 1
                node = self._next[node][ch]
            self._match[node] = len(stop)
        self._fail = [0] * len(self._next)
        self._hold = [0] * len(self._next)
        queue = deque(self._next[0].values())
        while queue:  # breadth first: a node's suffix nodes are done before it
            node = queue.popleft()
            fail = self._fail[node]
            self._match[node] = max(self._match[node], self._match[fail])
            self._hold[node] = self._depth[node] if self._next[node] else self._hold[fail]
            for ch, child in self._next[node].items():
                self._fail[child] = self._step(fail, ch)
                queue.append(child)

    def _step(self, node: int, ch: str) -> int:
        while node and ch not in self._next[node]:
            node = self._fail[node]
        return self._next[node].get(ch, 0)


class StopStringState:
    """One completion's place in its request's `StopStrings`."""

    def __init__(self, stops: StopStrings):
        self._stops = stops
        self._node = 0

    def feed(self, text: str, end: int) -> tuple[int, int] | None:
        """Advances over `text`, new text ending at offset `end` of the completion's text.

        Returns (start offset, length) of the earliest-starting stop string that ends inside
        `text` (of those starting there, the shortest: it is completed first), or None.
        """
        stops, found = self._stops, None
        for i, ch in enumerate(text):
            self._node = stops._step(self._node, ch)
            length = stops._match[self._node]
            if length:
                start = end - len(text) + i + 1 - length
                if found is None or start < found[0]:
                    found = (start, length)
        return found

    @property
    def num_held_back(self) -> int:
        """Characters at the end of the text that may still become a stop string."""
        return self._stops._hold[self._node]
