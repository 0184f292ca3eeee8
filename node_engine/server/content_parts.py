"""A chat message's content parts, as SGLang 0.5.23 takes them (``entrypoints/openai/protocol.py``
``ChatCompletionMessageContentPart``) and gives them to the chat template (``parser/jinja_template_utils.py``
``process_content_for_template_format``, then ``serving_chat.py`` ``normalize_tool_content``).

Each part is checked against its type's model and keeps only that model's fields. For the template:

- an ``"openai"`` template (:func:`node_engine.chat_template.content_format`) gets the list: a text part as
  ``{"type": "text", "text"}``, an image as ``{"type": "image"}`` (one placeholder; its URL joins the request's
  images), a ``tool_reference`` part as given (GLM templates resolve it against ``tools``);
- a ``"string"`` template gets the text parts joined with single spaces (an image still joins the request's
  images, so that a prompt without its placeholder is a 400, where SGLang drops the image unsaid);
- ``thinking`` / ``reasoning`` parts (assistant messages only) reach no template, as in SGLang's Jinja path;
- a ``tool`` message whose parts are all text gets them joined, whatever the template.

Video and audio parts are checked as SGLang checks them, then refused as ``unsupported``: the engine takes
text and images only (SGLang refuses them on a text model: ``serving_chat.py`` ``_validate_media_content``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from handoff.service.errors import Unsupported
from handoff.protocol.ignored_fields import IgnoresUnknown

__all__ = ["Content", "ContentPart", "ImagePart", "TextPart", "ThinkingPart", "refuse_unsupported_parts",
           "template_content"]

# SGLang's part models drop the fields they do not declare (pydantic's default): so do these (IgnoresUnknown)


class TextPart(IgnoresUnknown):
    ignored_where = "a content part"
    type: Literal["text"]
    text: str


class ThinkingPart(IgnoresUnknown):
    """A reasoning trace in an assistant's history: checked, then left out of the template."""

    ignored_where = "a content part"
    type: Literal["thinking", "reasoning"]
    thinking: str | None = None
    text: str | None = None

    @model_validator(mode="after")
    def _one_payload(self) -> ThinkingPart:
        if (self.thinking is None) == (self.text is None):
            raise ValueError("thinking parts require exactly one of 'thinking' or 'text'")
        return self


class ImageURL(IgnoresUnknown):
    ignored_where = "an image part's image_url"
    url: str
    detail: Literal["auto", "low", "high"] | None = "auto"
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    max_long_side_pixel: int | None = None
    content_hash: str | None = None

    @field_validator("detail", mode="before")
    @classmethod
    def _default_is_auto(cls, value: Any) -> Any:
        return "auto" if value == "default" else value


# an image's fields the engine cannot honour: refused unless null, never silently ignored
_IMAGE_DEFAULT_ONLY = ("max_dynamic_patch", "min_dynamic_patch", "max_long_side_pixel", "content_hash")


class ImagePart(IgnoresUnknown):
    ignored_where = "a content part"
    type: Literal["image_url"]
    image_url: ImageURL
    modalities: Literal["image", "multi-images", "video"] | None = "image"


class MediaURL(IgnoresUnknown):
    ignored_where = "a media part's URL"
    url: str


class VideoPart(IgnoresUnknown):
    ignored_where = "a content part"
    type: Literal["video_url"]
    video_url: MediaURL


class AudioURLPart(IgnoresUnknown):
    ignored_where = "a content part"
    type: Literal["audio_url"]
    audio_url: MediaURL


class InputAudio(IgnoresUnknown):
    ignored_where = "an input_audio part's input_audio"
    data: str
    format: Literal["wav", "mp3"]


class InputAudioPart(IgnoresUnknown):
    ignored_where = "a content part"
    type: Literal["input_audio"]
    input_audio: InputAudio


class ToolReferencePart(IgnoresUnknown):
    """GLM's reference to a deferred tool, which its template renders from ``tools``."""

    ignored_where = "a content part"
    type: Literal["tool_reference"]
    name: str


ContentPart = Annotated[Union[TextPart, ThinkingPart, ImagePart, VideoPart, AudioURLPart, InputAudioPart,
                              ToolReferencePart], Field(discriminator="type")]
# a message's content: a string, or a list of parts (tagged, so that an error names ``content.parts.<i>``)
Content = Annotated[Union[Annotated[str, Tag("string")], Annotated[list[ContentPart], Tag("parts")]],
                    Discriminator(lambda value: "string" if isinstance(value, str) else "parts")]
_MEDIA = (VideoPart, AudioURLPart, InputAudioPart)


def refuse_unsupported_parts(contents: list[Any]) -> None:
    """400 ``unsupported`` for the first video or audio part, or image field the engine cannot honour, among
    the messages' ``contents`` (strings, part lists or None)."""
    for n, content in enumerate(contents):
        for k, part in enumerate(content if isinstance(content, list) else ()):
            field = f"messages.{n}.content.{k}"
            if isinstance(part, _MEDIA):
                raise Unsupported(f"{field}: {part.type} parts are not supported by this engine (it takes text, "
                                  "and images on a vision-language model)", extra={"field": field})
            if isinstance(part, ImagePart):
                for name in _IMAGE_DEFAULT_ONLY:
                    if getattr(part.image_url, name) is not None:
                        raise Unsupported(f"{field}.image_url.{name}: not supported by this engine",
                                          extra={"field": f"{field}.image_url.{name}"})


def template_content(role: str, content: Any, content_format: str, images: list[object]) -> Any:
    """``content`` as the template gets it (None as ``""``); each image's URL is appended to ``images``."""
    if not isinstance(content, list):
        return "" if content is None else content
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, TextPart):
            parts.append({"type": "text", "text": part.text})
        elif isinstance(part, ImagePart):
            images.append(part.image_url.url)
            parts.append({"type": "image"})
        elif isinstance(part, ToolReferencePart):
            parts.append(part.model_dump())
    texts = [part["text"] for part in parts if part["type"] == "text"]
    if content_format == "string" or (role == "tool" and len(texts) == len(parts)):
        return " ".join(texts)
    return parts
