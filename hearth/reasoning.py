"""Reasoning in a model's reply: the thinking section split from the answer, whole or as it streams.

    fmt = FORMATS["qwen3"]                          # `hearth serve --reasoning-parser qwen3`
    split = fmt.parser(started=fmt.opened_by(prompt_text))
    for delta in text_deltas:
        reasoning, content = split.feed(delta)     # what each part gained; a possible marker is held back
    reasoning, content = split.feed("", final=True)
    # or split.update(whole_text_so_far, final): the same, for a caller holding the growing text

The formats:
  deepseek_r1, qwen3  <think>reasoning</think>answer. The section opens in the reply (Qwen 3) or in
                      the prompt, when the template ends with <think> (DeepSeek-R1, Qwen 3's thinking
                      2507 models): `opened_by(prompt)` says so, and the reply starts inside it.
  gpt_oss             OpenAI's harmony channels: <|channel|>analysis<|message|>reasoning<|end|>
                      <|start|>assistant<|channel|>final<|message|>answer (the markers are special
                      tokens: the reply is decoded with them, `needs_special_tokens`).

Whitespace around the reasoning and before the answer is dropped. The engine enforces a thinking
budget with the same markers (hearth/engine/thinking.py): after N tokens inside the section it
makes the model write `close` (the end of the section) and the answer follows.
"""

from __future__ import annotations

from dataclasses import dataclass


def _partial_tail(text: str, marker: str) -> int:
    """How many characters at the end of `text` begin `marker` (they may become it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplit:
    """A streamed reply split into reasoning and content: feed text deltas, get what each part gained."""

    def __init__(self) -> None:
        self.received = 0  # characters of the reply fed so far
        self.pending = ""  # text received and not yet given to a part
        self.reasoning = ""
        self.content = ""

    def update(self, text: str, final: bool = False) -> tuple[str, str]:
        """feed() for a caller that holds the whole reply so far: `text` is it, grown or not."""
        return self.feed(text[self.received:], final)

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the content that `delta` adds (final: the reply is whole, nothing held)."""
        before = len(self.reasoning), len(self.content)
        self.received += len(delta)
        self.pending += delta
        self._advance(final)
        return self.reasoning[before[0]:], self.content[before[1]:]

    def _advance(self, final: bool) -> None:
        raise NotImplementedError


class ThinkSplit(ReasoningSplit):
    """<think>...</think>: states "start" (the reply may open the section), "reasoning", "answer"."""

    def __init__(self, start: str, end: str, started: bool) -> None:
        super().__init__()
        self.start, self.end = start, end
        self.state = "reasoning" if started else "start"
        self.answer_started = False  # a character of the answer was given (leading whitespace is dropped)

    def _advance(self, final: bool) -> None:
        if self.state == "start":
            text = self.pending.lstrip()
            if text.startswith(self.start):
                self.state, self.pending = "reasoning", text[len(self.start):]
            elif self.start.startswith(text) and not final:
                return  # only whitespace, or the start of the marker: wait
            else:
                self.state = "answer"
        if self.state == "reasoning":
            at = self.pending.find(self.end)
            if at < 0:
                text = self.pending
                keep = len(text) - (0 if final else _partial_tail(text, self.end))
                if not final:  # trailing whitespace waits: it is dropped if the section ends after it
                    keep = min(keep, len(text[:keep].rstrip()))
                self._reason(text[:keep])
                self.pending = text[keep:]
                return
            self._reason(self.pending[:at].rstrip())
            self.state, self.pending = "answer", self.pending[at + len(self.end):]
        if self.state == "answer":
            text = self.pending if self.answer_started else self.pending.lstrip()
            self.answer_started = self.answer_started or bool(text)
            self.content += text
            self.pending = ""

    def _reason(self, text: str) -> None:
        self.reasoning += text if self.reasoning else text.lstrip()


# what ends a harmony message's body (hearth/tool_calls.py reads the same messages)
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>", "<|channel|>")


class HarmonySplit(ReasoningSplit):
    """Harmony's messages: <|channel|>NAME<|message|>text<|end|>; analysis is reasoning, the other
    channels (final, commentary) content. States "outside" (between messages), "header", "body"."""

    def __init__(self, started: bool) -> None:
        super().__init__()
        self.state, self.channel = ("body", "analysis") if started else ("outside", "")

    def _advance(self, final: bool) -> None:
        while self.pending:
            if self.state == "outside":
                at = self.pending.find("<|channel|>")
                if at < 0:
                    if final:  # a reply without channels: its text, less the role markers
                        self.content += self.pending.replace("<|start|>", "").removeprefix("assistant")
                        self.pending = ""
                    return
                self.state, self.pending = "header", self.pending[at + len("<|channel|>"):]
            elif self.state == "header":
                at = self.pending.find("<|message|>")
                if at < 0:
                    return
                self.channel = (self.pending[:at].split() or [""])[0]
                self.state, self.pending = "body", self.pending[at + len("<|message|>"):]
            else:
                ends = [i for i in (self.pending.find(m) for m in HARMONY_ENDS) if i >= 0]
                at = min(ends, default=-1)
                held = 0 if final else max(_partial_tail(self.pending, m) for m in HARMONY_ENDS)
                cut = at if at >= 0 else len(self.pending) - held
                self._body(self.pending[:cut])
                self.pending = self.pending[cut:]
                if at < 0:
                    return
                self.state = "outside"

    def _body(self, text: str) -> None:
        if self.channel == "analysis":
            self.reasoning += text
        else:
            self.content += text


@dataclass(frozen=True)
class ReasoningFormat:
    """A family's thinking markers: `start` opens the section, `end` closes it as the model writes it,
    `close` is what the engine makes the model write when a thinking budget runs out."""

    name: str
    start: str
    end: str
    close: str
    needs_special_tokens: bool = False  # the markers are special tokens: decode the reply with them

    def opened_by(self, prompt: str) -> bool:
        """The prompt ends inside an open section (the template wrote the start marker)."""
        at = prompt.rfind(self.start)
        return at >= 0 and prompt.find(self.end, at) < 0 and not prompt[at + len(self.start):].strip()

    def parser(self, started: bool = False) -> ReasoningSplit:
        """A new streaming split of one reply; `started`: the reply begins inside the section."""
        if self.name == "gpt_oss":
            return HarmonySplit(started)
        return ThinkSplit(self.start, self.end, started)

    def split(self, text: str, started: bool = False) -> tuple[str, str]:
        """A whole reply's (reasoning, content)."""
        return self.parser(started).feed(text, final=True)


_THINK = dict(start="<think>", end="</think>", close="</think>")
FORMATS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", **_THINK),
    "qwen3": ReasoningFormat("qwen3", **_THINK),
    "gpt_oss": ReasoningFormat("gpt_oss", "<|channel|>analysis<|message|>", "<|end|>",
                               "<|end|><|start|>assistant<|channel|>final<|message|>", needs_special_tokens=True),
}
