"""A yes/no modal (used before clearing the prefix cache): ``y`` confirms, ``n``/Esc cancels."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label


class ConfirmScreen(ModalScreen[bool]):
    """Asks ``question``; dismisses with True (yes) or False (no)."""

    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n", "answer(False)", "No"),
                Binding("escape", "answer(False)", "No", show=False)]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        """The question and two buttons."""
        with Vertical(id="confirm-box"):
            yield Label(self.question, id="confirm-question")
            with Horizontal(id="confirm-buttons"):
                yield Button("Yes (y)", id="confirm-yes", variant="error")
                yield Button("No (n)", id="confirm-no", variant="primary")

    def on_mount(self) -> None:
        """Focus "No" so Enter does not destroy anything by accident."""
        self.query_one("#confirm-no", Button).focus()

    def action_answer(self, yes: bool) -> None:
        """Close the dialog with the answer."""
        self.dismiss(yes)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        """A button click answers like its key."""
        self.dismiss(event.button.id == "confirm-yes")
