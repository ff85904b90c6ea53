"""prompt_format.PromptFormat: text -> prompt tokens, raw or in a chat template; and the same through
`tforce run` and `tforce chat` on a tiny model whose tokenizer carries a template (greedy answers equal
plain decoding of the templated ids, chat's pieces equal run's whole prompt)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

import tforce
from tforce.cli import app
from tforce.errors import UsageError
from tforce.text.format import PromptFormat
from tforce.model.synthetic import byte_tokenizer, make_checkpoint

from cli_helpers import DOC, FAST, TARGET, one_error_line
from template_helpers import HEADERS, templated_pair, tokenizer_with

LLAMA2_TOKENIZER = Path(__file__).resolve().parents[3] / "shared" / "models" / "llama2-tokenizer"
# Llama 2 chat's layout ([INST] turns, ' </s>' after an answer), as its tokenizer_config.json writes it
LLAMA2_CHAT = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
# Mistral-7B-Instruct-v0.3's layout: the system message goes to the last user turn, wherever that is
MISTRAL_V3 = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + "
    "'[/INST]' }}{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}{%- endif %}{%- endfor %}")


def _llama2(template: str | None = None):
    if not LLAMA2_TOKENIZER.is_dir():
        pytest.skip(f"the Llama 2 tokenizer is absent ({LLAMA2_TOKENIZER})")
    tok = AutoTokenizer.from_pretrained(LLAMA2_TOKENIZER)
    tok.chat_template = template
    return tok


def _render(tok, messages) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


def test_raw_text_is_tokenized_as_before():
    tok = tokenizer_with(None)
    fmt = PromptFormat(tok)
    assert not fmt.templated
    assert fmt.prompt_ids(DOC + "\n\nWho?") == tok.encode(DOC + "\n\nWho?")
    assert fmt.document_ids(DOC) == tok.encode(DOC + "\n\n")  # the blank line a first question follows
    assert not PromptFormat(tokenizer_with(HEADERS), "none").templated


@pytest.mark.parametrize("template", [None, LLAMA2_CHAT])
def test_chat_pieces_are_run_prompt_tokens_with_sentencepiece(template):
    """Tokenized alone, "\\n\\nWho?" gets SentencePiece's leading space ('▁'), which the whole prompt
    does not have: chat's question pieces are tokenized as they come after the document."""
    tok = _llama2(template)
    fmt = PromptFormat(tok)
    assert fmt.templated == (template is not None)
    for doc, q in [(DOC, "Who?"), ("Call me Ishmael", "Why the sea?"), ("x\n", "  spaced"), ("\n  Chapter 1", "Who?")]:
        whole = fmt.prompt_ids(doc + "\n\n" + q)
        assert fmt.document_ids(doc) + fmt.question_ids(q) == whole
    if template is None:  # the old chat pieces differ here; the test would catch going back to them
        assert tok.encode("\n\nWho?", add_special_tokens=False) != fmt.question_ids("Who?")


# Llama 3's pre-tokenizer: punctuation takes the newlines after it (" ?[^\s\p{L}\p{N}]+[\r\n]*")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _llama3_style(template: str | None):
    """A byte-level BPE with Llama 3's pre-tokenizer, trained here on text full of ".\n\n"."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    corpus = [f"It was the age of {w}.\n\nWho wrote it?\n\n" for w in ("wisdom", "folly", "light", "darkness")] * 50
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<|eot|>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                  additional_special_tokens=["<|eot|>", "<|user|>", "<|assistant|>", "<|system|>"])
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("template", [None, HEADERS])
def test_chat_pieces_are_run_prompt_tokens_where_punctuation_takes_the_blank_line(template):
    """With Llama 3's pre-tokenizer "wisdom.\n\nWho?" is "wisdom", ".\n\n", "Who", "?": a document piece that
    ended at "." and a question piece starting "\n\n" gave chat other ids than run's."""
    tok = _llama3_style(template)
    fmt = PromptFormat(tok)
    assert ".\n\n" in tok.convert_tokens_to_string(tok.convert_ids_to_tokens(tok.encode("wisdom.\n\nWho?")))
    for doc, q in [("It was the age of wisdom.", "Who wrote it?"), ("It was the age of folly", "Who?"),
                   ("Light.\n", "Who wrote it?")]:
        assert fmt.document_ids(doc) + fmt.question_ids(q) == fmt.prompt_ids(doc + "\n\n" + q)
        # a document's tokens without the blank line (a snapshot of an earlier tforce) get it with the question
        old = tok.encode(doc) if template is None else fmt._encode(fmt._head + doc)
        assert not fmt.ends_with_separator(old) and fmt.ends_with_separator(fmt.document_ids(doc))
        assert tok.decode(old + fmt.question_ids(q, separated=False)) == tok.decode(fmt.prompt_ids(doc + "\n\n" + q))


DEMO_TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "demo-target"


@pytest.mark.parametrize("template", [None, HEADERS])
def test_chat_pieces_are_run_prompt_tokens_where_a_blank_line_at_the_end_is_one_token(template):
    """The demo pair's byte-level BPE (GPT-2's pre-tokenizer) makes one token of "\\n\\n" at the end of a
    text but two "\\n" tokens before a word ("of\\n\\nWhat": "\\n", "\\n", "What"): a document piece
    tokenized with the blank line at its end gave chat other ids than run (and other answers) for every
    document, on the default model. Before a digit the same pre-tokenizer keeps "\\n\\n" one token (its
    digits split first), so a question that starts with a digit still gets other ids there (README)."""
    if not (DEMO_TOKENIZER / "tokenizer.json").exists():
        pytest.skip(f"the demo pair is absent ({DEMO_TOKENIZER})")
    tok = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    tok.add_special_tokens({"additional_special_tokens": ["<|eot|>", "<|user|>", "<|assistant|>"]})
    tok.chat_template = template
    fmt = PromptFormat(tok)
    assert tok.encode("of\n\n")[-1] not in tok.encode("of\n\nWhat")
    for doc, q in [("Call me Ishmael. Some years ago", "What does the narrator call himself?"),
                   ("It was the age of wisdom.", "Who?"), ("Light.\n", "\u201cWhy?\u201d"), ("x", "Or 43?")]:
        assert fmt.document_ids(doc) + fmt.question_ids(q) == fmt.prompt_ids(doc + "\n\n" + q)
        assert fmt.ends_with_separator(fmt.document_ids(doc))


@pytest.mark.parametrize("template", [HEADERS, LLAMA2_CHAT])
def test_templated_prompt_is_the_rendered_conversation(template):
    tok = tokenizer_with(template)
    fmt = PromptFormat(tok, system="Answer briefly.")
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": DOC + "\n\nWho?"}]
    assert fmt.prompt_ids(DOC + "\n\nWho?") == _render(tok, messages)
    assert fmt.document_ids(DOC) + fmt.question_ids("Who?") == _render(tok, messages)
    # both templates strip a message's leading whitespace, so a document's piece loses it as run's prompt does
    assert fmt.document_ids("\n  " + DOC) + fmt.question_ids("Who?") == fmt.prompt_ids("\n  " + DOC + "\n\nWho?")
    assert tok.decode(fmt.prompt_ids("x")).count("Answer briefly.") == 1


def test_a_later_question_follows_the_answer_without_a_second_turn_end():
    tok = tokenizer_with(HEADERS)
    fmt = PromptFormat(tok)
    eot = tok.convert_tokens_to_ids("<|eot|>")
    answer = tok.encode("Dickens.", add_special_tokens=False)
    closed = fmt.question_ids("When?", answer + [eot])
    assert tok.decode(closed) == "<|user|>\n\nWhen?<|eot|><|assistant|>\n\n"
    # the whole conversation, as the template lays it out, is the history's tokens
    history = fmt.document_ids(DOC) + fmt.question_ids("Who?") + answer + [eot] + closed
    assert history == _render(tok, [{"role": "user", "content": DOC + "\n\nWho?"},
                                    {"role": "assistant", "content": "Dickens."}, {"role": "user", "content": "When?"}])
    # an answer cut by --max-new-tokens has not closed its turn: the template's end comes first
    assert tok.decode(fmt.question_ids("When?", answer)) == "<|eot|><|user|>\n\nWhen?<|eot|><|assistant|>\n\n"
    # Llama 2 writes ' </s>' after an answer: an answer ending in </s> is not given another
    tok2 = tokenizer_with(LLAMA2_CHAT)
    fmt2 = PromptFormat(tok2)
    assert tok2.decode(fmt2.question_ids("When?", answer + [tok2.eos_token_id])) == "<s>[INST] When? [/INST]"
    assert tok2.decode(fmt2.question_ids("When?", answer)) == " </s><s>[INST] When? [/INST]"


def test_keep_history_refused_where_a_later_turn_rewrites_the_first():
    """Mistral v0.3 with a system message writes it in the first turn of a one-question conversation and in
    the second of a two-question one: appending the second turn after the prefilled first is not the
    template's layout. Without --system the conversation grows by appending, and keeping it is allowed."""
    tok = tokenizer_with(MISTRAL_V3)
    answer = tok.encode(" Dickens.", add_special_tokens=False)  # the template writes a space before an answer
    plain = PromptFormat(tok)
    history = plain.document_ids(DOC) + plain.question_ids("Who?") + answer + plain.question_ids("When?", answer)
    assert history == _render(tok, [{"role": "user", "content": DOC + "\n\nWho?"},
                                    {"role": "assistant", "content": "Dickens."}, {"role": "user", "content": "When?"}])
    system = PromptFormat(tok, system="Be brief.")
    assert system.document_ids(DOC) + system.question_ids("Who?") == system.prompt_ids(DOC + "\n\nWho?")
    with pytest.raises(UsageError, match="--keep-history: .* with --system lays out"):
        system.question_ids("When?", answer)


def test_refusals_are_usage_errors():
    with pytest.raises(UsageError, match="--system needs a chat template"):
        PromptFormat(tokenizer_with(None), system="x")
    with pytest.raises(UsageError, match="--system needs a chat template"):
        PromptFormat(tokenizer_with(HEADERS), "none", system="x")
    with pytest.raises(UsageError, match="--template must be one of"):
        PromptFormat(tokenizer_with(HEADERS), "chatml")
    refuses = "{{ raise_exception('System role not supported') if messages[0]['role'] == 'system' }}" + HEADERS
    with pytest.raises(UsageError, match="System role not supported"):
        PromptFormat(tokenizer_with(refuses), system="x")
    shouting = HEADERS.replace("m['content'] | trim", "m['content'] | upper")
    with pytest.raises(UsageError, match="does not keep a message's text"):
        PromptFormat(tokenizer_with(shouting))
    fmt = PromptFormat(tokenizer_with(HEADERS))
    fmt.check_document(fmt.document_ids(DOC), "the snapshot")
    with pytest.raises(UsageError, match="does not begin with"):
        fmt.check_document(tokenizer_with(None).encode(DOC), "the snapshot")


# ----------------------------------------------------------------------------------- the commands


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return templated_pair(tmp_path_factory.mktemp("template"), HEADERS)


def _cli(models, command, *args, input=None):
    base = [command, "-m", str(models / "chat-target"), "--draft", str(models / "chat-draft"), *FAST, "--method",
            "triforce"]
    return CliRunner().invoke(app, base + list(args), input=input)


def _greedy(models, ids: list[int]) -> list[int]:
    target = tforce.load_model(str(models / "chat-target"))
    return tforce.generate(target.model, ids, method="ar", max_new_tokens=12, temperature=0).tokens


def _templated(models, *messages) -> list[int]:
    tok = AutoTokenizer.from_pretrained(models / "chat-target")
    return _render(tok, list(messages))


@pytest.mark.parametrize("method", ["triforce", "ar"])
def test_run_lays_the_prompt_out_in_the_template(models, method):
    r = _cli(models, "run", str(models / "doc.txt"), "-p", "Who?", "--system", "Be brief.", "--json",
             "--method", method)
    assert r.exit_code == 0, (r.output, r.exception)
    obj = json.loads(r.stdout)
    ids = _templated(models, {"role": "system", "content": "Be brief."}, {"role": "user", "content": DOC + "\n\nWho?"})
    assert obj["chat_template"] is True and obj["prompt_tokens"] == len(ids)
    assert obj["tokens"] == _greedy(models, ids)
    assert "chat template" in r.stderr
    raw = _cli(models, "run", str(models / "doc.txt"), "-p", "Who?", "--json", "--template", "none")
    assert raw.exit_code == 0, (raw.output, raw.exception)
    obj = json.loads(raw.stdout)
    assert obj["chat_template"] is False and obj["tokens"] == _greedy(models, byte_tokenizer().encode(DOC + "\n\nWho?"))


def test_chat_answers_are_run_answers_in_the_template(models):
    r = _cli(models, "chat", str(models / "doc.txt"), "--json", "--keep-history", input="Who?\nWhen?\n")
    assert r.exit_code == 0, (r.output, r.exception)
    first, second = [json.loads(line) for line in r.stdout.splitlines()]
    ids = _templated(models, {"role": "user", "content": DOC + "\n\nWho?"})
    assert first["tokens"] == _greedy(models, ids)
    fmt = PromptFormat(AutoTokenizer.from_pretrained(models / "chat-target"))
    assert second["tokens"] == _greedy(models, ids + first["tokens"] + fmt.question_ids("When?", first["tokens"]))
    alone = _cli(models, "chat", str(models / "doc.txt"), "--json", input="When?\n")
    assert json.loads(alone.stdout)["tokens"] == _greedy(
        models, _templated(models, {"role": "user", "content": DOC + "\n\nWhen?"}))


def test_batch_lines_are_laid_out_in_the_template(models, tmp_path):
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps({"prompt": "Who?", "file": str(models / "doc.txt")}) + "\n")
    r = _cli(models, "run", "--batch", str(batch), "--method", "ar")
    assert r.exit_code == 0, (r.output, r.exception)
    ids = _templated(models, {"role": "user", "content": DOC + "\n\nWho?"})
    assert json.loads(r.stdout.splitlines()[0])["tokens"] == _greedy(models, ids)


@pytest.mark.parametrize("args, needle", [
    (["--template", "chatml"], "--template must be one of"),
    (["--template", "none", "--system", "x"], "--system needs a chat template"),
])
def test_template_options_refused_in_one_line(models, args, needle):
    one_error_line(_cli(models, "run", str(models / "doc.txt"), *args), 2, needle)


def test_system_without_a_template_refused_in_one_line(tmp_path):
    make_checkpoint(tmp_path / "base", seed=0, **TARGET)
    r = CliRunner().invoke(app, ["run", "-m", str(tmp_path / "base"), "-p", "hi", "--method", "ar", "--system", "x"])
    one_error_line(r, 2, "has no chat template")


def test_chat_keep_history_refused_in_one_line_where_the_template_rewrites_turns(models, tmp_path):
    import shutil

    shutil.copytree(models / "chat-target", tmp_path / "mistral")
    tokenizer_with(MISTRAL_V3).save_pretrained(tmp_path / "mistral")
    r = CliRunner().invoke(app, ["chat", str(models / "doc.txt"), "-m", str(tmp_path / "mistral"), "--method", "ar",
                                 "--system", "Be brief.", "--keep-history"], input="Who?\nWhen?\n")
    one_error_line(r, 2, "--keep-history")


def test_templated_chat_refuses_a_raw_snapshot(models, tmp_path):
    raw = _cli(models, "run", str(models / "doc.txt"), "--template", "none", "--method", "ar", "-n", "1",
               "--save-kv", str(tmp_path / "kv"))
    assert raw.exit_code == 0, (raw.output, raw.exception)
    one_error_line(_cli(models, "chat", "--load-kv", str(tmp_path / "kv"), "--method", "ar", input="Who?\n"), 2,
                   "does not begin with")
    ok = _cli(models, "chat", "--load-kv", str(tmp_path / "kv"), "--method", "ar", "--template", "none",
              "--json", input="Who?\n")
    assert ok.exit_code == 0, (ok.output, ok.exception)


def test_info_says_how_prompts_are_laid_out_and_where_runs_stop(models, tmp_path):
    r = CliRunner().invoke(app, ["info", "-m", str(models / "chat-target"), "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    m = json.loads(r.stdout)["model"]
    assert (m["tokenizer"], m["chat_template"], m["eos_token_ids"]) == (True, True, [2])
    make_checkpoint(tmp_path / "bare", seed=0, tokenizer=False, **TARGET)
    (tmp_path / "bare" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    r = CliRunner().invoke(app, ["info", "-m", str(tmp_path / "bare")])
    assert r.exit_code == 0, (r.output, r.exception)
    assert "no tokenizer; end-of-sequence ids [2, 7]" in " ".join(r.stdout.split())


def test_a_later_question_after_an_answer_that_ended_its_turn(models, monkeypatch):
    """Conversation keeps end-of-sequence tokens out of the history, so a question after an answer that
    ended with the end-of-turn token must start with the template's turn end (else the history would have
    none). Conversation.ask is wrapped so that its first answer ends with <|eot|>, made an end-of-sequence id."""
    import tforce.engine.conversation

    tok = AutoTokenizer.from_pretrained(models / "chat-target")
    eot = tok.convert_tokens_to_ids("<|eot|>")
    asked, ask = [], tforce.engine.conversation.Conversation.ask

    def ending_its_turn(self, question_ids, *a, **k):
        asked.append(list(question_ids))
        result = ask(self, question_ids, *a, **k)
        return tforce.Result(result.tokens + [eot], result.stats) if len(asked) == 1 else result

    monkeypatch.setattr(tforce.engine.conversation.Conversation, "ask", ending_its_turn)
    monkeypatch.setattr(tforce.engine.generate, "eos_ids", lambda config: {2, eot})
    r = _cli(models, "chat", str(models / "doc.txt"), "--json", "--keep-history", "--method", "ar",
             input="Who?\nWhen?\n")
    assert r.exit_code == 0, (r.output, r.exception)
    assert tok.decode(asked[1]) == "<|eot|><|user|>\n\nWhen?<|eot|><|assistant|>\n\n"


def test_templated_chat_refuses_a_whole_prompt_snapshot(models, tmp_path):
    """`tforce run BOOK --save-kv` in the template keeps the prompt through the assistant's header: chat put
    its questions after it, inside the answer's turn. Refused in one line; chat's own snapshot loads."""
    run = _cli(models, "run", str(models / "doc.txt"), "--method", "ar", "-n", "1", "--save-kv", str(tmp_path / "run"))
    assert run.exit_code == 0, (run.output, run.exception)
    one_error_line(_cli(models, "chat", "--load-kv", str(tmp_path / "run"), "--method", "ar", input="Who?\n"), 2,
                   "holds a whole prompt")
    saved = _cli(models, "chat", str(models / "doc.txt"), "--method", "ar", "--save-kv", str(tmp_path / "doc"),
                 input="Who?\n")
    assert saved.exit_code == 0, (saved.output, saved.exception)
    loaded = _cli(models, "chat", "--load-kv", str(tmp_path / "doc"), "--method", "ar", "--json", input="Who?\n")
    assert loaded.exit_code == 0, (loaded.output, loaded.exception)
    assert json.loads(loaded.stdout)["tokens"] == _greedy(
        models, _templated(models, {"role": "user", "content": DOC + "\n\nWho?"}))


def test_raw_chat_refuses_a_templated_snapshot(models, tmp_path):
    """The reverse of a raw snapshot in a templated chat: --template none put raw questions after a document
    whose user turn the template had opened. Refused in one line, with --system too; raw snapshots load."""
    for system in ([], ["--system", "Be brief."]):
        saved = _cli(models, "chat", str(models / "doc.txt"), "--method", "ar", "--save-kv", str(tmp_path / "kv"),
                     *system, input="Who?\n")
        assert saved.exit_code == 0, (saved.output, saved.exception)
        one_error_line(_cli(models, "chat", "--load-kv", str(tmp_path / "kv"), "--method", "ar", "--template", "none",
                            input="Who?\n"), 2, "begins with")
    raw = _cli(models, "chat", str(models / "doc.txt"), "--method", "ar", "--template", "none", "--save-kv",
               str(tmp_path / "raw"), input="Who?\n")
    assert raw.exit_code == 0, (raw.output, raw.exception)
    loaded = _cli(models, "chat", "--load-kv", str(tmp_path / "raw"), "--method", "ar", "--template", "none",
                  input="Who?\n")
    assert loaded.exit_code == 0, (loaded.output, loaded.exception)
    # a template that drops system messages: the same opening with any
    tok = tokenizer_with(HEADERS.replace("{% for m in messages %}", "{% for m in messages if m['role'] != 'system' %}"))
    with pytest.raises(UsageError, match="begins with"):
        PromptFormat(tok, "none").check_document(PromptFormat(tok).document_ids(DOC), "the snapshot")
