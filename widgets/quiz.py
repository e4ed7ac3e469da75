"""``Quiz``: multiple-choice questions whose wrong answers explain the slip in reasoning."""
from __future__ import annotations

import html
import numbers
from dataclasses import dataclass

import ipywidgets as W

from ._base import STYLE, CourseWidget
from ._main_thread import on_main_thread


@dataclass
class Question:
    """One question.

    Attributes:
        prompt: the question text (HTML allowed).
        choices: the answers, in display order.
        correct: index of the right answer in ``choices``.
        explanations: one per choice: for a wrong one, where the reasoning went wrong;
            for the right one, why it is right.
    """

    prompt: str
    choices: list[str]
    correct: int
    explanations: list[str]

    def __post_init__(self) -> None:
        for name in ("choices", "explanations"):  # a string would be taken letter by letter
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
                raise ValueError(f"question {str(self.prompt)[:40]!r}: {name} must be a list of strings, got {value!r}")
        if len(self.choices) < 2:
            raise ValueError(f"question {self.prompt[:40]!r}: needs at least 2 choices, got {len(self.choices)}")
        if len(self.explanations) != len(self.choices):
            raise ValueError(f"question {self.prompt[:40]!r}: {len(self.explanations)} explanations for "
                             f"{len(self.choices)} choices")
        c = self.correct
        if isinstance(c, bool) or not isinstance(c, numbers.Integral) or not 0 <= c < len(self.choices):
            raise ValueError(f"question {self.prompt[:40]!r}: correct={self.correct!r} is not a choice index")


class Quiz(CourseWidget):
    """Questions with radio buttons and a "Check" button per question.

    Nothing is measured here: the feedback is the question author's explanation of the
    chosen answer. State for code and tests: ``answers`` (question index -> chosen
    index), ``score`` (right answers among those checked).

    Args:
        questions: ``Question`` objects, or dicts with the same fields.

    Raises:
        ValueError: no list of questions, no questions, or a malformed one (fewer than 2 choices, explanations not one per
            choice, ``correct`` not a choice index), naming it.
    """

    def __init__(self, questions):
        super().__init__()
        if isinstance(questions, (str, bytes, dict, Question)) or not hasattr(questions, "__iter__"):
            raise ValueError(f"Quiz takes a list of questions (Question objects or dicts), got {questions!r}")
        self.questions = [q if isinstance(q, Question) else Question(**q) for q in questions]
        if not self.questions:
            raise ValueError("Quiz needs at least one question")
        self.answers: dict[int, int] = {}
        self.radios, self.feedback, self.buttons = [], [], []
        blocks = [W.HTML(STYLE)]
        for i, q in enumerate(self.questions):
            radio = W.RadioButtons(options=[(c, j) for j, c in enumerate(q.choices)], value=None,
                                   layout=W.Layout(width="auto"))
            button = W.Button(description="Check", icon="check")
            button.add_class("mv-quiz-check")
            fb = W.HTML()
            button.on_click(on_main_thread(lambda _b, i=i: self.check(i)))
            self.radios.append(radio)
            self.buttons.append(button)
            self.feedback.append(fb)
            blocks.append(W.VBox([W.HTML(f"<div class='mv-box'><b>Q{i + 1}.</b> {q.prompt}</div>"), radio,
                                  button, fb], layout=W.Layout(margin="0 0 12px 0")))
        self.add_class("mv-quiz")
        self.children = blocks

    def check(self, i: int, choice: int | None = None) -> bool | None:
        """Check question ``i`` (with ``choice``, or the selected radio); returns right/wrong,
        or None when nothing is selected.

        Raises:
            ValueError: ``i`` not a question index, or ``choice`` not an answer index of it."""
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < len(self.questions):
            raise ValueError(f"i={i!r} is not a question index (this quiz has {len(self.questions)})")
        q = self.questions[i]
        if choice is not None:
            if isinstance(choice, bool) or not isinstance(choice, numbers.Integral) or not 0 <= choice < len(q.choices):
                raise ValueError(f"choice={choice!r} is not an answer index of question {i}")
            self.radios[i].value = int(choice)
        chosen = self.radios[i].value
        if chosen is None:
            self.feedback[i].value = "<div class='mv-box mv-small'>Pick an answer first.</div>"
            return None
        self.answers[i] = chosen
        right = chosen == q.correct
        colour, word = ("#2a7a2a", "Right.") if right else ("#b00", "Not quite.")
        explanation = q.explanations[chosen]
        lead = "" if explanation.lower().startswith(word[:-1].lower()) else f"<b>{word}</b> "  # not "Right. Right: ..."
        self.feedback[i].value = f"<div class='mv-box' style='color:{colour}'>{lead}{explanation}</div>"
        return right

    @property
    def score(self) -> int:
        """Right answers among the questions checked so far."""
        return sum(1 for i, c in self.answers.items() if c == self.questions[i].correct)

    def static_html(self) -> str:
        parts = []
        for i, q in enumerate(self.questions):
            opts = "".join(f"<li>{html.escape(c)}</li>" for c in q.choices)
            parts.append(f"<div class='mv-box'><b>Q{i + 1}.</b> {q.prompt}<ol type='a'>{opts}</ol></div>")
        return "".join(parts) + "<div class='mv-small'>(run the notebook to check answers)</div>"
