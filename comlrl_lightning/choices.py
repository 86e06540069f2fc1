"""A configuration choice declared once: its canonical values and the other spellings CoMLRL accepts for them.

One :class:`Choice` gives both what the parser needs and what the code needs::

    JOINT_MODE = Choice("joint_mode", {"aligned": ("align",), "cross": ("crossed",)})
    JointMode = JOINT_MODE.Literal            # the field's type: every accepted spelling (--help lists them)
    JOINT_MODE("Crossed")                      # -> "cross"; an unknown value -> one-line ValueError

so a table of aliases is never written twice (once as the ``Literal``, once as the normaliser).
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Mapping, Sequence


def _spelled(value: Any) -> str:
    return str(value).strip().lower()


class Choice:
    """``field``'s allowed values: ``values`` maps each canonical value to its other spellings. ``spelling``
    turns what a user wrote into the form the table holds (default: stripped, lower case); ``message`` is the
    error's template (``{field}``, ``{value}``, ``{allowed}``, ``{aliases}``), CoMLRL's wording where it has one.
    """

    def __init__(
        self,
        field: str,
        values: Mapping[str, Sequence[str]] | Sequence[str],
        *,
        spelling: Callable[[Any], str] = _spelled,
        message: str | None = None,
    ):
        values = values if isinstance(values, Mapping) else {value: () for value in values}
        self.field, self.spelling = field, spelling
        self.values: tuple[str, ...] = tuple(values)
        self.aliases: dict[str, str] = {value: value for value in values}
        for value, others in values.items():
            self.aliases.update({other: value for other in others})
        self.message = message or "{field} must be one of: {allowed}{aliases} (got {value!r})."

    @property
    def Literal(self) -> Any:  # noqa: N802 - it is a type
        """``Literal[...]`` of every accepted spelling, canonical values first."""
        return Literal[tuple(self.aliases)]

    def __call__(self, value: Any) -> str:
        """The canonical value ``value`` spells; ValueError naming the field, the value and the choices."""
        key = self.spelling(value)
        if key not in self.aliases:
            others = [alias for alias in self.aliases if alias not in self.values]
            raise ValueError(
                self.message.format(
                    field=self.field,
                    value=value,
                    allowed=", ".join(self.values),
                    aliases=f" (aliases: {', '.join(others)})" if others else "",
                )
            )
        return self.aliases[key]
