"""Go ``text/template`` for Ollama chat templates.

Ollama ships every model's prompt format as a Go ``text/template`` (the Modelfile ``TEMPLATE``).
To serve those models ourselves we must produce *exactly* the prompt text Ollama would: a single
differing byte changes the tokens, which breaks prompt-cache reuse and makes outputs diverge from
what users get from Ollama. So this package reimplements, with Go's semantics, the part of
``text/template`` that chat templates use; Ollama's layer on top is
:mod:`sidecar.templates.ollama`. The modules follow Go's layout: ``lex``, ``nodes`` and ``parse``
(text/template/parse), ``exec`` and ``funcs`` (text/template), and ``values``, ``fmt``,
``strconv`` and ``json`` for the parts of Go's runtime and standard library templates observe.

Supported template language (as in Go 1.22+):

* text and ``{{ }}`` actions, ``{{-`` / ``-}}`` trim markers, ``{{/* comments */}}``;
* pipelines with ``|``, parenthesised sub-pipelines, ``$x := ...`` / ``$x = ...`` / ``$``;
* field chains (``.A.B``, ``$m.Role``, ``(pipeline).Field``) on mappings and Go-like structs;
* ``if``/``else if``/``else``, ``with``/``else with``/``else``, ``range`` (one or two variables,
  ``else``, ``break``/``continue``, over lists, maps in sorted key order and ints);
* string (interpreted and raw), character, int, float, bool and ``nil`` literals;
* Go's builtins ``and or not len index slice eq ne lt le gt ge print printf println html js
  urlquery`` and Ollama's ``json``, ``currentDate`` and ``yesterdayDate``.

Not supported (parse error): ``define``/``template``/``block``, ``call``, method calls, complex
numbers. Everything else in Go's grammar is accepted and behaves like Go.

The node types are public so that code can walk a parsed template (:attr:`GoTemplate.root`) the
way Ollama walks Go's parse tree.
"""

from sidecar.templates.gotemplate.nodes import (
    ActionNode,
    ArgNode,
    BranchNode,
    CommandNode,
    FieldNode,
    ListNode,
    Node,
    PipeNode,
    TextNode,
    VariableNode,
)
from sidecar.templates.gotemplate.template import GoTemplate, TemplateError

__all__ = [
    "ActionNode",
    "ArgNode",
    "BranchNode",
    "CommandNode",
    "FieldNode",
    "GoTemplate",
    "ListNode",
    "Node",
    "PipeNode",
    "TemplateError",
    "TextNode",
    "VariableNode",
]
