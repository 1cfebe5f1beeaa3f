"""SystemOne requests: validation, and the Clef prompt with its token spans.

The prompt is the file's systemone template rendered into pieces (format/template.py),
tokenized piece by piece exactly as the reference's encode_record does: the head
averages hidden states over the spans of those pieces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ModelFileError, RequestError
from ..format import temperatures as T
from ..format import vision as V
from ..format.contract import QUESTION_TYPES
from ..format.template import OMITTED, PromptTemplate
from .images import ImageLimits, PreparedImage, prepare_all, request_images

if TYPE_CHECKING:
    from .catalog import ModelRef

MAX_QUESTIONS = 64
CHOICE_OPTIONS = T.OPTION_COUNTS["choice"]
SCORE_LEVELS = T.OPTION_COUNTS["score"]
NOUL_OPTIONS = ("true", "false")
Tokenize = Callable[[str], list[int]]
Description = str | dict | list | None


@dataclass(frozen=True)
class Question:
    id: str
    type: str
    instructions: Description
    options: tuple[tuple[str, Description], ...]  # in prompt order (choice: sorted by name)
    levels: tuple[Description, ...] = ()  # score: the criteria list, for the legend
    criteria_order: tuple[str, ...] = ()  # choice: option names as the request lists them

    @property
    def listed(self) -> list[str]:
        """Option names in the request's order, as answers list them."""
        return list(self.criteria_order) or [name for name, _ in self.options]


@dataclass(frozen=True)
class Request:
    model: str | None
    state: str | dict | list
    questions: tuple[Question, ...]
    images: tuple[PreparedImage, ...] = ()  # placed where the template puts images (before the state)
    lora: str | None = None  # Workers AI's name of a fine-tune: the model it picks, over `model`

    @property
    def named_by(self) -> str:
        """The field that names the model: Workers AI's `lora` where it is given, else System One's `model`."""
        return "lora" if self.lora is not None else "model"

    @property
    def named(self) -> str | None:
        """The model the request names (in its field named_by)."""
        return self.lora if self.lora is not None else self.model


@dataclass(frozen=True)
class EncodedQuestion:
    question: Question
    span: tuple[int, int]  # the instruction tokens
    option_spans: tuple[tuple[int, int], ...]

    @property
    def type(self) -> str:
        return self.question.type


@dataclass(frozen=True)
class PlacedImage:
    image: PreparedImage
    start: int  # the index of its first image token in the prompt's tokens


@dataclass(frozen=True)
class EncodedPrompt:
    request: Request
    tokens: list[int]  # an image's tokens are <|image_pad|>s, whose embeddings the vision tower's replace
    questions: tuple[EncodedQuestion, ...]
    # tokens[:state_prefix] are the template's pieces up to and including the state: the same for
    # every request about this state, whatever its questions (0: the template has no such prefix).
    state_prefix: int = 0
    images: tuple[PlacedImage, ...] = ()
    # tokens[:preamble] are the template's pieces before the request's first own one (its images or its
    # state): the system prompt and the user turn's opening, the same for every request to the model.
    preamble: int = 0
    # The model its request named, resolved once (runtime/catalog.py): the base or one of its adapters, by identity
    # (whose vocabulary and template encoded it), the name its answer gives, and its catalog entry. None: made by hand.
    model: ModelRef | None = None

    @property
    def identity(self) -> str:
        """Its model's identity: a batch is one model's, and the state cache's keys hold it ("" when made by hand)."""
        return self.model.identity if self.model is not None else ""

    @property
    def model_name(self) -> str:
        """The name its answer's `model` and the metrics' label give its model."""
        return self.model.name if self.model is not None else ""

    @property
    def named_by(self) -> str:
        """The request's field that named its model (Request.named_by): where a 422 about that model points."""
        return self.request.named_by


# --- Validation -------------------------------------------------------------------------------------------
def _is_description(value: Any) -> bool:
    return value is None or isinstance(value, (str, dict, list))


def _check_description(value: Any, where: str) -> Description:
    if not _is_description(value):
        raise RequestError(f"must be a string, an object, an array or null, not {type(value).__name__}", where)
    return value


def _options(qid: str, qtype: str, criteria: Any) -> tuple[tuple[tuple[str, Description], ...], tuple[Description, ...]]:
    where = f"questions.{qid}.criteria"
    if qtype == "noul":
        if criteria is None:
            criteria = {}
        if not isinstance(criteria, dict) or not set(criteria) <= set(NOUL_OPTIONS):
            raise RequestError('must be null or an object with the keys "true" and/or "false"', where)
        # As the reference: an absent option gets the template's default description, one given as null none.
        described = {k: OMITTED if v is None else _check_description(v, f"{where}.{k}") for k, v in criteria.items()}
        return tuple((k, described.get(k)) for k in NOUL_OPTIONS), ()
    if qtype == "choice":
        low, high = CHOICE_OPTIONS
        if not isinstance(criteria, dict) or not low <= len(criteria) <= high:
            raise RequestError(f"must be an object of {low} to {high} options (option name -> description)", where)
        for name, value in criteria.items():
            if not name:
                raise RequestError("option names must not be empty", where)
            _check_description(value, f"{where}.{name}")
        return tuple(sorted(criteria.items())), ()
    low, high = SCORE_LEVELS
    if not isinstance(criteria, list) or not low <= len(criteria) <= high:
        raise RequestError(f"must be a list of {low} to {high} levels", where)
    levels = tuple(_check_level(v, f"{where}.{i}") for i, v in enumerate(criteria))
    return tuple((str(i), v) for i, v in enumerate(levels)), levels


def _check_level(value: Any, where: str) -> Description:
    # TypeSafe's schema allows no null level (a choice option may be null, a score level may not), and
    # the answer's legend repeats the levels: typesafe-sdk refuses a response whose legend holds a null.
    if value is None:
        raise RequestError("a score level must be a string, an object or an array, not null", where)
    return _check_description(value, where)


def parse_request(body: Any, image_limits: ImageLimits | None = None) -> Request:
    """Check a SystemOne request body; raise RequestError naming the field.

    image_limits: the vision tower's (None: the model has none, and a request with images is refused)."""
    if not isinstance(body, dict):
        raise RequestError("the request must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("must be a string", "model")
    lora = body.get("lora")
    if lora is not None and not isinstance(lora, str):
        raise RequestError("must be the name of a fine-tune (a string)", "lora")
    if "state" not in body:
        raise RequestError("is required", "state")
    state = body["state"]
    if not isinstance(state, (str, dict, list)):
        raise RequestError("must be a string, an object or an array", "state")
    questions = body.get("questions")
    if not isinstance(questions, dict) or not 1 <= len(questions) <= MAX_QUESTIONS:
        raise RequestError(f"must be an object of 1 to {MAX_QUESTIONS} questions", "questions")
    parsed = []
    for qid, q in questions.items():
        if not qid:
            raise RequestError("question ids must not be empty", "questions")
        if not isinstance(q, dict):
            raise RequestError("must be an object", f"questions.{qid}")
        qtype = q.get("type")
        if qtype not in QUESTION_TYPES:
            raise RequestError("must be noul, choice or score", f"questions.{qid}.type")
        instructions = _check_description(q.get("instructions"), f"questions.{qid}.instructions")
        options, levels = _options(qid, qtype, q.get("criteria"))
        order = tuple(q["criteria"]) if qtype == "choice" else ()
        parsed.append(Question(qid, qtype, instructions, options, levels, order))
    values, state = request_images(body, state)
    return Request(model, state, tuple(parsed), prepare_all(values, image_limits), lora)


# --- Encoding ---------------------------------------------------------------------------------------------------
def encode(request: Request, template: PromptTemplate, tokenize: Tokenize, model: ModelRef | None = None) -> EncodedPrompt:
    """Token ids and spans: the template's pieces, each tokenized on its own as in the reference's encode_record."""
    questions = [
        {
            "id": q.id,
            "type": q.type,
            # The reference's rule: no instructions means the id is the instructions.
            "instructions": q.id if q.instructions is None or q.instructions == "" else q.instructions,
            "options": [{"key": key, "description": description} for key, description in q.options],
        }
        for q in request.questions
    ]
    tokens: list[int] = []
    spans: list[tuple[int, int]] = []
    option_spans: list[list[tuple[int, int]]] = []
    state_prefix = 0
    preamble: int | None = None
    placed: list[PlacedImage] = []
    images = iter(request.images)
    state_piece = template.state_piece_of(len(request.images))
    for index, piece in enumerate(template.pieces(request.state, questions, len(request.images))):
        start = len(tokens)
        if preamble is None and (piece.kind == "image" or index == state_piece):
            preamble = start
        if piece.kind == "image":
            image = next(images, None)
            if image is None:
                raise ModelFileError("the systemone prompt template places an image more than once")
            # As the reference's processor expands its placeholder: the pads tokenized with the brackets.
            tokens += tokenize(V.VISION_START)
            placed.append(PlacedImage(image, len(tokens)))
            tokens += tokenize(V.IMAGE_PAD) * image.n_tokens
            tokens += tokenize(V.VISION_END)
        else:
            tokens += tokenize(piece.text)
        if index == state_piece:
            state_prefix = len(tokens)
        if piece.kind == "question":
            spans.append((start, len(tokens)))
            option_spans.append([])
        elif piece.kind == "option" and option_spans:
            option_spans[-1].append((start, len(tokens)))
    if [len(o) for o in option_spans] != [len(q.options) for q in request.questions]:
        raise ModelFileError("the systemone prompt template does not mark every question and option once")
    if len(placed) != len(request.images):
        raise ModelFileError("the systemone prompt template does not place every image")
    encoded = tuple(EncodedQuestion(q, span, tuple(o)) for q, span, o in zip(request.questions, spans, option_spans, strict=True))
    return EncodedPrompt(request, tokens, encoded, state_prefix, tuple(placed), preamble or 0, model)
