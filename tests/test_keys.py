"""One key-template mechanism for ``@lock``, views and saves (django_dlock.keys)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
from django.test import RequestFactory

from django_dlock import lock
from django_dlock.keys import KeyTemplate
from django_dlock.saves import instance_lock_name
from django_dlock.views import lock_view, view_lock_name
from tests.models import Document


def _request(pk: int | None = None) -> object:
    request = RequestFactory().get("/")
    request.user = SimpleNamespace(pk=pk)  # type: ignore[attr-defined]
    return request


def test_the_same_syntax_fills_from_each_source() -> None:
    template = "doc:{doc.pk}:{tags[0]}:{{literal}}"

    def call(doc: object, tags: list[str]) -> None: ...

    doc = SimpleNamespace(pk=7)
    from_call = KeyTemplate(template, inspect.signature(call), "call").format((doc, ["a"]), {})
    from_view = view_lock_name(template, _request(), {"doc": doc, "tags": ["a"]})
    instance = Document(pk=7, title="x")
    instance.doc = doc  # type: ignore[attr-defined]
    instance.tags = ["a"]  # type: ignore[attr-defined]
    from_instance = instance_lock_name(instance, template)
    assert from_call == from_view == from_instance == "doc:7:a:{literal}"


def test_view_names_see_the_user() -> None:
    assert view_lock_name("cart:{user_pk}", _request(pk=4), {}) == "cart:4"


def test_instance_names_see_app_label_and_model_name() -> None:
    doc = Document(pk=3, title="x")
    assert instance_lock_name(doc) == "tests.document:3"
    assert instance_lock_name(doc, "{model_name}/{title}") == "document/x"


@pytest.mark.parametrize("template", ["a:{}", "a:{0}", "{0.pk}"])
def test_positional_fields_are_refused_everywhere(template: str) -> None:
    message = "must name arguments"
    with pytest.raises(ValueError, match=message):
        lock(template)(lambda x: x)
    with pytest.raises(ValueError, match=message):
        lock_view(template)
    with pytest.raises(ValueError, match=message):
        instance_lock_name(Document(pk=1, title="x"), template)


def test_a_decorated_function_must_take_the_named_arguments() -> None:
    def f(invoice_id: int) -> None: ...

    with pytest.raises(ValueError, match=r"names \['order'\], which .*f\(\) does not take"):
        lock("order:{order}")(f)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((1, 2), {}), ((1,), {"b": 2}), ((), {"b": 2, "a": 1}), ((1,), {"a": 2}),
     ((1, 2, 3), {}), ((1,), {"c": 2}), ((1,), {}), ((), {})],
)  # fmt: skip
def test_arguments_bind_as_the_signature_does(
    args: tuple[int, ...], kwargs: dict[str, int]
) -> None:
    """Plain parameters are zipped with the arguments, not bound: same values, same errors."""

    def f(a: int, b: int) -> None: ...

    signature = inspect.signature(f)
    template = KeyTemplate("{a}:{b}", signature)
    try:
        expected = dict(signature.bind(*args, **kwargs).arguments)
    except TypeError as e:
        with pytest.raises(TypeError, match=str(e)):
            template.arguments(args, kwargs)
    else:
        assert template.arguments(args, kwargs) == expected
        assert template.format(args, kwargs) == f"{expected['a']}:{expected['b']}"
