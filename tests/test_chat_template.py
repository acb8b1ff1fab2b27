"""Chat templates given instead of the model's (vLLM's): `LLM.chat(chat_template=)`, `serve
--chat-template` (a file or the template itself) and a request's own `chat_template`, which a
server renders only when started with --trust-request-chat-template."""
from __future__ import annotations

import httpx
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.chat import load_chat_template
from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.entrypoints.limits import ServerLimits
from nanovllm.entrypoints.server import create_app
from test_server import KEY, MODEL, assert_error_body, serve_in_thread

SERVER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
REQUEST_TEMPLATE = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
SERVER_RENDERED = "[system] Be brief.\n[user] Name a colour.\n"
REQUEST_RENDERED = "<Be brief.><Name a colour.>"


def test_llm_chat_renders_the_template_it_is_given(qwen3_tiny):
    llm = LLM(str(qwen3_tiny), device="cpu", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=2)
    out = llm.chat(MESSAGES, params, use_tqdm=False, chat_template=SERVER_TEMPLATE)[0]
    assert llm.tokenizer.decode(out.prompt_token_ids) == SERVER_RENDERED
    own = llm.chat(MESSAGES, params, use_tqdm=False)[0]
    assert llm.tokenizer.decode(own.prompt_token_ids) != SERVER_RENDERED  # the model's own template


def test_a_template_is_a_file_or_its_text(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(SERVER_TEMPLATE)
    assert load_chat_template(str(path)) == SERVER_TEMPLATE
    assert load_chat_template(REQUEST_TEMPLATE) == REQUEST_TEMPLATE
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_serve_flags(tmp_path, capsys):
    from nanovllm.entrypoints.cli import build_parser
    from nanovllm.entrypoints.limits import limits_from_args

    path = tmp_path / "template.jinja"
    path.write_text(SERVER_TEMPLATE)
    limits = limits_from_args(build_parser().parse_args(["serve", "--chat-template", str(path),
                                                         "--trust-request-chat-template"]))
    assert limits.chat_template == SERVER_TEMPLATE and limits.trust_request_chat_template
    default = limits_from_args(build_parser().parse_args(["serve"]))
    assert default.chat_template is None and not default.trust_request_chat_template
    with pytest.raises(SystemExit) as exit_info:  # before the model loads
        build_parser().parse_args(["serve", "--chat-template", str(tmp_path / "missing.jinja")])
    assert exit_info.value.code == 2 and "no such file" in capsys.readouterr().err


@pytest.fixture(scope="module")
def engine(qwen3_tiny):
    engine = AsyncEngine.from_kwargs(str(qwen3_tiny), device="cpu", max_model_len=256, num_kvcache_blocks=64)
    yield engine
    engine.shutdown()


def client(engine, **limits):
    app = create_app(engine, MODEL, api_key=KEY, limits=ServerLimits(**limits))
    return serve_in_thread(app)


def chat(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "temperature": 0, **body})


def test_the_servers_template_renders_every_chat(engine):
    tok = engine.tokenizer
    with client(engine, chat_template=SERVER_TEMPLATE) as url:
        http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        tokens = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        assert tok.decode(tokens) == SERVER_RENDERED
        r = chat(http)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tokens)
        err = assert_error_body(chat(http, chat_template=REQUEST_TEMPLATE), 400)
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]


def test_a_trusting_server_renders_a_requests_template(engine):
    tok = engine.tokenizer
    with client(engine, trust_request_chat_template=True) as url:
        http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        r = chat(http, chat_template=REQUEST_TEMPLATE, logprobs=False)
        assert r.status_code == 200, r.text
        expected = tok.encode(REQUEST_RENDERED, add_special_tokens=False)
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
        own = chat(http).json()["usage"]["prompt_tokens"]  # no template in the request: the model's
        assert own != len(expected)
        err = assert_error_body(chat(http, chat_template="{% for m in messages %}"), 400)  # unclosed block
        assert err["param"] == "chat_template" and "chat template" in err["message"]
        assert chat(http).status_code == 200  # the server goes on serving


@pytest.mark.parametrize("template, kwargs", [
    ("{{ 1 / 0 }}", None),  # ZeroDivisionError
    ("{% for i in range(10**6) %}{% endfor %}", None),  # the sandbox's range limit: OverflowError
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", None),  # RecursionError
    ("{{ 'x'.encode('no-such-codec') }}", None),  # LookupError
    ("{{ 'abc'.index('z') }}", None),  # ValueError
    ("{{ 10 / n }}", {"n": 0}),  # through the request's chat_template_kwargs
])
def test_whatever_a_requests_template_raises_is_a_400_naming_chat_template(engine, template, kwargs):
    """A template is code: any exception it raises while rendering is the request's error (400
    naming chat_template, on /v1/chat/completions and /tokenize alike), never a 500."""
    with client(engine, trust_request_chat_template=True) as url:
        http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        extra = {"chat_template_kwargs": kwargs} if kwargs else {}
        err = assert_error_body(chat(http, chat_template=template, **extra), 400)
        assert err["param"] == "chat_template" and "chat template" in err["message"]
        r = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": template, **extra})
        assert assert_error_body(r, 400)["param"] == "chat_template"
        assert chat(http).status_code == 200


def test_the_llm_chat_api_raises_a_value_error_for_a_failing_template(qwen3_tiny):
    from nanovllm.chat import ChatTemplateError, chat_prompt_ids
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_tiny))
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        chat_prompt_ids(tokenizer, MESSAGES, chat_template="{{ 1 / 0 }}")


def test_tokenize_renders_a_chat_as_the_chat_endpoint_does(engine, tmp_path):
    """/tokenize counts what /v1/chat/completions will see: with the request's own template on
    a trusting server (a 400 naming chat_template on one that is not), with special-token text
    parsed where the server parses it, and naming `tools` for bad tool definitions."""
    tok = engine.tokenizer
    with client(engine, trust_request_chat_template=True) as url:
        http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        r = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": REQUEST_TEMPLATE})
        assert r.status_code == 200, r.text
        assert tok.decode(r.json()["tokens"]) == REQUEST_RENDERED
        assert r.json()["count"] == chat(http, chat_template=REQUEST_TEMPLATE).json()["usage"]["prompt_tokens"]
        bad_tools = [{"type": "function", "function": {"name": "bad name!"}}]
        err = assert_error_body(http.post("/tokenize", json={"messages": MESSAGES, "tools": bad_tools}), 400)
        assert err["param"] == "tools"
    with client(engine) as url:
        http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        r = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": REQUEST_TEMPLATE})
        assert assert_error_body(r, 400)["param"] == "chat_template"
    special = tok.eos_token
    messages = [{"role": "user", "content": f"Hi {special} there"}]
    with client(engine, chat_template=SERVER_TEMPLATE, parse_special_tokens_in_chat=True) as url:
        http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        count = http.post("/tokenize", json={"messages": messages}).json()["count"]
        used = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
        assert count == used["usage"]["prompt_tokens"]
        assert tok.eos_token_id in http.post("/tokenize", json={"messages": messages}).json()["tokens"]
