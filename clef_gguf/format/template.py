"""The `systemone` prompt template of a Clef file: the one convert writes, and its rendering into the pieces the model reads.

A Clef GGUF carries its prompt as the Jinja chat template `tokenizer.chat_template.systemone`
(llama.cpp's converter writes it; docs/format.md). It is rendered with the input llama.cpp's
server gives it: `state`, `questions` ([{id, type, instructions, options: [{key,
description}]}]), `images`, and three markers: `sep` between the pieces of the prompt (each
piece is tokenized on its own, as the reference tokenizes them), `mark_question` and
`mark_option` at the start of the pieces whose tokens a question's and an option's spans are.

Where llama-server departs from Cloudflare's reference, this follows the reference:
  * JSON as the reference's json.dumps writes it (keys sorted, floats in full), not 6 digits;
  * missing or empty instructions are the question's id, not an error;
  * a noul option whose description is given as null has none (the template would put the
    default one in): it is passed as OMITTED, which `tojson` leaves out;
  * the text is never altered (llama-server rewrites "<<clef:" in it): the markers here carry
    a random nonce instead.

The template is data from a file: it is rendered in Jinja's immutable sandbox, and only the
constructs of the systemone template are accepted (loops over questions, their options and
the images; the filter tojson; no calls, macros or includes), so that rendering stays linear
in the request, whatever the file says.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateSyntaxError, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ModelFileError

_NONCE = secrets.token_hex(8)
SEP = f"\ue000sep:{_NONCE}\ue000"
MARK_QUESTION = f"\ue000question:{_NONCE}\ue000"
MARK_OPTION = f"\ue000option:{_NONCE}\ue000"
MARK_IMAGE = f"\ue000image:{_NONCE}\ue000"  # what the template's `images` hold: one per image, where it goes
OMITTED = object()  # a description given as null where the template would supply a default

_LOOPS = ("questions", "images")  # top-level names a loop may run over; and `<loop variable>.options`
_FILTERS = {"tojson"}
_TESTS = {"string", "none"}
_FORBIDDEN = (
    nodes.Call,
    nodes.Macro,
    nodes.CallBlock,
    nodes.FilterBlock,
    nodes.Import,
    nodes.FromImport,
    nodes.Include,
    nodes.Extends,
    nodes.Block,
    nodes.Scope,
    nodes.ScopedEvalContextModifier,
)


# --- The template convert writes ---------------------------------------------------------
# The reference's encode_record() as the Jinja template llama.cpp's converter stores
# (`tokenizer.chat_template.systemone`, contract.KEY_TEMPLATE). Literal text is a JSON-quoted
# Jinja string, so the stored template is exactly llama.cpp's.
SYSTEM_PROMPT = (
    "Read the complete state and schema. Decide every field jointly. Each answer "
    "must be exactly one of that field's allowed options."
)
NOUL_DEFAULTS = {
    "true": "The proposition is true or the answer is yes.",
    "false": "The proposition is false or the answer is no.",
}


def _text(value: str) -> str:
    return "{{ " + json.dumps(value) + " }}"


def _value(name: str) -> str:  # strings as they are, anything else compact JSON
    return "{{ " + name + " if " + name + " is string else " + name + " | tojson(separators=[',', ':']) }}"


_OPTION = (
    "{% set d = o.description %}"
    "{% if q.type == 'noul' and d is none %}"
    f"{{% set d = '{NOUL_DEFAULTS['true']}' if o.key == 'true' else '{NOUL_DEFAULTS['false']}' %}}"
    "{% endif %}"
    "{{ ({'option_id': o.key} if d is none else {'description': d, 'option_id': o.key}) | tojson(separators=[',', ':']) }}"
)
SYSTEMONE_TEMPLATE = (
    _text(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nSTATE:\n")
    + "{% if images %}{{ sep }}{% for image in images %}{{ image }}{% endfor %}"
    + _text("\n")
    + "{% endif %}"
    + "{{ sep }}"
    + _value("state")
    + "{{ sep }}"
    + _text("\n\nSCHEMA FIELDS:\n")
    + "{% for q in questions %}"
    + "{{ sep }}"
    + _text("\nFIELD ")
    + "{{ loop.index }}"
    + _text("\nID: ")
    + "{{ q.id }}"
    + _text("\nTYPE: ")
    + "{{ q.type }}"
    + _text("\nINSTRUCTION: ")
    + "{{ sep }}{{ mark_question }}"
    + _value("q.instructions")
    + "{{ sep }}"
    + _text("\nALLOWED OPTIONS:\n")
    + "{% for o in q.options %}"
    + "{{ sep }}"
    + _text("OPTION ")
    + "{{ loop.index }}"
    + _text(": ")
    + "{{ sep }}{{ mark_option }}"
    + _OPTION
    + "{{ sep }}"
    + _text("\n")
    + "{% endfor %}"
    + "{{ sep }}"
    + _text("END FIELD\n")
    + "{% endfor %}"
    + "{{ sep }}"
    + _text("\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:")
)

# Special tokens the template relies on; validate checks the vocabulary has them.
TEMPLATE_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")


# --- Rendering a file's template ----------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    text: str
    # "question" (its instructions), "option" (its description), "image" (one image, text ""); None otherwise
    kind: str | None = None


def _tojson(value: Any, separators: list[str] | tuple[str, str] | None = None, **_: Any) -> str:
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if v is not OMITTED}
    return json.dumps(value, ensure_ascii=False, separators=tuple(separators) if separators else (",", ":"), sort_keys=True)


def _check(tree: nodes.Template) -> None:
    """Refuse anything but what the systemone template uses: its rendering is then bounded by the request."""
    for node in tree.find_all(_FORBIDDEN):
        raise ModelFileError(f"the systemone prompt template uses {type(node).__name__}, which clef-gguf does not render")
    for node in tree.find_all(nodes.Filter):
        if node.name not in _FILTERS:
            raise ModelFileError(f"the systemone prompt template uses the filter {node.name!r}, which clef-gguf does not render")
    for node in tree.find_all(nodes.Test):
        if node.name not in _TESTS:
            raise ModelFileError(f"the systemone prompt template uses the test {node.name!r}, which clef-gguf does not render")
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        over_list = isinstance(it, nodes.Name) and it.name in _LOOPS
        over_options = isinstance(it, nodes.Getattr) and it.attr == "options" and isinstance(it.node, nodes.Name)
        if not (over_list or over_options) or loop.recursive:
            raise ModelFileError("the systemone prompt template loops over something other than questions, options or images")


class PromptTemplate:
    """A compiled systemone template: request -> pieces."""

    def __init__(self, source: str) -> None:
        env = ImmutableSandboxedEnvironment(autoescape=False, keep_trailing_newline=True)
        env.filters = {"tojson": _tojson}
        env.tests = {"string": lambda v: isinstance(v, str), "none": lambda v: v is None}
        try:
            _check(env.parse(source))
            self._template = env.from_string(source)
        except TemplateSyntaxError as e:
            raise ModelFileError(f"the systemone prompt template does not parse: {e.message} (line {e.lineno})") from e
        self.source = source
        self._state_pieces: dict[int, int | None] = {}
        self.state_piece = self.state_piece_of(0)

    def state_piece_of(self, n_images: int) -> int | None:
        """The state's piece in a prompt with `n_images` images (they are pieces of their own)."""
        if n_images not in self._state_pieces:
            self._state_pieces[n_images] = self._find_state_piece(n_images)
        return self._state_pieces[n_images]

    def _find_state_piece(self, n_images: int) -> int | None:
        """The index of the piece that holds the state, when no piece up to it depends on the questions.

        Clef's prompt puts the state first, so the tokens of the pieces up to and including it
        are the same for every request about that state: the prefix the state cache keeps
        (pieces are tokenized one by one, so it is an exact token boundary). Found by rendering
        two probe states under two probe schemas; None (no reusable prefix) for a template that
        puts anything that depends on the questions before or into the state's piece. Reusing
        the prefix of any boundary would still give the same answers: the backbone is causal,
        and a cache entry is keyed by the exact prefix tokens.
        """
        option = {"key": "true", "description": None}
        schemas = (
            [{"id": "a", "type": "noul", "instructions": "a", "options": [option]}],
            [{"id": "b", "type": "choice", "instructions": {"b": 1}, "options": [option, {"key": "c", "description": "d"}]}] * 2,
        )
        x, y = (list(self.pieces(state, schemas[0], n_images)) for state in (f"x{_NONCE}", f"y{_NONCE}"))
        index = next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), None)
        if index is None or list(self.pieces(f"x{_NONCE}", schemas[1], n_images))[: index + 1] != x[: index + 1]:
            return None
        return index

    def pieces(self, state: Any, questions: list[dict[str, Any]], n_images: int = 0) -> Iterator[Piece]:
        """The prompt's pieces, in order. questions: [{id, type, instructions, options: [{key, description}]}].

        Each image is a piece of kind "image" where the template puts it (llama-server gives the template
        mtmd's media markers, which mtmd replaces by the image's tokens)."""
        text = self._template.render(
            state=state,
            questions=questions,
            images=[MARK_IMAGE] * n_images,
            sep=SEP,
            mark_question=MARK_QUESTION,
            mark_option=MARK_OPTION,
        )
        for piece in text.split(SEP):
            if MARK_IMAGE in piece:
                first, *rest = piece.split(MARK_IMAGE)
                yield from (Piece(first),) if first else ()
                for part in rest:
                    yield Piece("", "image")
                    yield from (Piece(part),) if part else ()
            elif piece.startswith(MARK_QUESTION):
                yield Piece(piece[len(MARK_QUESTION) :], "question")
            elif piece.startswith(MARK_OPTION):
                yield Piece(piece[len(MARK_OPTION) :], "option")
            else:
                yield Piece(piece)
