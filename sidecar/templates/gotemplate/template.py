"""The template object (Go's text/template Template): parse once, execute many times."""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping
from typing import Any

from sidecar.templates.gotemplate.exec import ExecError, execute
from sidecar.templates.gotemplate.funcs import DEFAULT_FUNCS, Func
from sidecar.templates.gotemplate.nodes import ListNode
from sidecar.templates.gotemplate.parse import ParseError, parse


class TemplateError(ValueError):
    """A template failed to parse or to execute.

    ``line`` and ``column`` (1-based, in characters) locate the offending source position so a
    broken Modelfile TEMPLATE can be fixed without guesswork; they are ``None`` for errors that
    have no single source position.
    """

    def __init__(self, message: str, *, line: int | None = None, column: int | None = None,
                 go: str | None = None) -> None:
        super().__init__(message)
        self.line = line
        self.column = column
        # The error as Go's text/template words it (what Ollama answers); the message above
        # names the column in characters, for a Modelfile TEMPLATE to be fixed without guesswork.
        self.go = message if go is None else go


class GoTemplate:
    """A Go ``text/template``, parsed once and executable many times (thread-safe).

    Parsing validates everything Go validates at parse time (syntax, declared variables, known
    functions) and raises :class:`TemplateError` naming the line and column.
    """

    def __init__(self, source: str, *, name: str = "") -> None:
        self._source = source
        self._name = name
        self._line_starts = [0, *(m.end() for m in re.finditer("\n", source))]
        try:
            self._root = parse(source, DEFAULT_FUNCS)
        except ParseError as e:
            raise self._parse_error(e.message, e.pos) from None
        except RecursionError:
            # Go refuses parentheses nested past 10,000 (parse.go, maxStackDepth); each level here
            # is a few Python frames, so a few hundred reach Python's limit first. Go's words.
            raise self._parse_error("max expression depth exceeded", None) from None

    @property
    def source(self) -> str:
        """The template text as given."""
        return self._source

    @property
    def name(self) -> str:
        """Name used to prefix error messages (may be empty)."""
        return self._name

    @property
    def root(self) -> ListNode:
        """The parsed tree (Go's ``Tree.Root``), for walks over the template.

        Executions share it, so never modify it: build a new tree from its nodes instead.
        """
        return self._root

    def execute(self, data: Mapping[str, Any]) -> str:
        """Render with ``data`` as both ``.`` and ``$``.

        Mapping keys are looked up by exact (Go-style, capitalised) field name; a missing key
        yields an empty value that prints as "" (the zero value templates expect), never an error.
        Raises :class:`TemplateError` on execution errors (bad index, wrong types, ...).
        """
        return self.execute_tree(self._root, data)

    def execute_tree(
        self, root: ListNode, data: Any, *, funcs: Mapping[str, Func] = DEFAULT_FUNCS, nil_text: str = ""
    ) -> str:
        """Run ``root``, :attr:`root` or a tree built from its nodes, as Go runs an added parse tree.

        ``funcs`` are the functions available to it (a call to any other fails, as in a Go
        template made without them); ``nil_text`` is what a nil value prints as: "" suits plain
        mappings, Go prints "<no value>" for a missing key of a ``map[string]any``. Errors name
        positions in this template's source.
        """
        try:
            return execute(root, data, funcs, nil_text)
        except ExecError as e:
            raise self._exec_error(e.message, e.pos, e.context) from None
        except RecursionError:
            raise self._exec_error("exceeded maximum template depth", None, None) from None

    def _place(self, pos: int) -> tuple[int, int]:
        """Line and column (1-based, characters) of a source position."""
        line = bisect.bisect_right(self._line_starts, pos)
        return line, pos - self._line_starts[line - 1] + 1

    def _parse_error(self, message: str, pos: int | None) -> TemplateError:
        """Go: `template: NAME:LINE: message` (parse.go, Tree.errorf)."""
        prefix = f"{self._name}: " if self._name else ""
        if pos is None:
            line = self._source.count("\n") + 1  # no single place: the last line
            return TemplateError(f"template: {prefix}{message}", go=f"template: {self._name}:{line}: {message}")
        line, column = self._place(pos)
        return TemplateError(f"template: {prefix}line {line}, column {column}: {message}", line=line,
                             column=column, go=f"template: {self._name}:{line}: {message}")

    def _exec_error(self, message: str, pos: int | None, context: str | None) -> TemplateError:
        """Go: `template: NAME:LINE:BYTE: executing "NAME" at <NODE>: message`, the whole node (exec.go,
        state.errorf; parse.go, ErrorContext, which no longer cuts it at 20 bytes), or
        `template: NAME: message`."""
        where = f"at <{context}>: " if context is not None else ""
        prefix = f"{self._name}: " if self._name else ""
        if pos is None:
            return TemplateError(f"template: {prefix}{message}", go=f"template: {self._name}: {message}")
        line, column = self._place(pos)
        byte = len(self._source[self._line_starts[line - 1]:pos].encode())
        go = f'template: {self._name}:{line}:{byte}: executing "{self._name}" at <{context or ""}>: {message}'
        return TemplateError(f"template: {prefix}line {line}, column {column}: executing {where}{message}",
                             line=line, column=column, go=go)

    def __repr__(self) -> str:
        return f"GoTemplate(name={self._name!r}, source={self._source[:40]!r}...)"
