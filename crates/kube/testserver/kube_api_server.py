#!/usr/bin/env python3
"""A Kubernetes API-shaped test server for gpuci's `kubernetes` fleet provider.

This is NOT a real Kubernetes API server. It serves the slice of core/v1 that the provider uses
(pods, pods/log, secrets, nodes, namespace GET), in JSON, with the real API's paths, Status bodies,
resourceVersions, list/watch semantics and selectors. Objects are validated against the official
JSON schemas shipped by the `kubernetes-validate` package. A simulated scheduler binds pods to nodes
read from a file (with `nvidia.com/gpu` capacity and taints) and a simulated kubelet runs the first
container's command as a local process. See README.md beside this file.

Usage:
    python kube_api_server.py --port 0 --token TOKEN --nodes NODES.json --log-dir DIR \
        [--kubernetes-version 1.30.0] [--rbac ROLE.yaml --rbac-user NAME]

stdout carries exactly one line, `listening on 127.0.0.1:PORT`; logs go to stderr.
"""

from __future__ import annotations

import argparse
import base64
import collections
import copy
import ctypes
import datetime
import decimal
import fractions
import functools
import hashlib
import hmac
import http.server
import itertools
import json
import logging
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid

import kubernetes_validate
import kubernetes_validate.utils
import yaml

# kubernetes_validate.validate re-reads its (immutable) schema files on every call; caching them
# makes a validation ~8x faster (about 2 ms instead of 14 ms).
kubernetes_validate.utils.schema_contents = functools.lru_cache(maxsize=None)(
    kubernetes_validate.utils.schema_contents)

LOG = logging.getLogger("kube-testserver")

GPU = "nvidia.com/gpu"
GPU_ANNOTATION = "testserver.gpuci/gpus"
HISTORY_LIMIT = 1000
MAX_WATCH_SECONDS = 1800
BOOKMARK_INTERVAL = 1.0
KUBELET_RETRY = 0.3
IMAGE_BACKOFF_AFTER = 1.0
EVICTION_GRACE = 2.0
DEADLINE_GRACE = 2.0
TICK = 0.1
MAX_PODS_PER_NODE = 110
TERMINAL = ("Succeeded", "Failed")

KINDS = {"pods": "Pod", "secrets": "Secret", "nodes": "Node", "namespaces": "Namespace"}
NAMESPACED = {"pods": True, "secrets": True, "nodes": False, "namespaces": False}
RW_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
RESOURCE_VERBS = {
    "pods": RW_VERBS,
    "secrets": RW_VERBS,
    "nodes": ["get", "list", "watch"],
    "namespaces": ["get"],
}
SUBRESOURCE_VERBS = {("pods", "log"): ["get"]}
FIELD_SELECTORS = {
    "pods": ("metadata.name", "metadata.namespace", "status.phase", "spec.nodeName",
             "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName", "status.podIP"),
    "secrets": ("metadata.name", "metadata.namespace", "type"),
    "nodes": ("metadata.name", "spec.unschedulable"),
}
NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # the alphabet the API server uses for generateName

MERGE_PATCH = ("application/merge-patch+json", "application/strategic-merge-patch+json")
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"


def now_rfc3339(offset_seconds: float = 0) -> str:
    t = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=offset_seconds)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def truthy(value: str | None) -> bool:
    return (value or "").strip() in ("1", "t", "T", "true", "True", "TRUE")


# ---------------------------------------------------------------------------------------------
# Errors, shaped as the API server's metav1.Status bodies


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def body(self) -> dict:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason}
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _details(resource: str, name: str | None) -> dict:
    d = {}
    if name:
        d["name"] = name
    d["kind"] = resource
    return d


def not_found(resource: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{resource} "{name}" not found', _details(resource, name))


def path_not_found() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


def already_exists(resource: str, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{resource} "{name}" already exists',
                    _details(resource, name))


def conflict(resource: str, name: str, why: str) -> ApiError:
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {resource} "{name}": {why}',
                    _details(resource, name))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def method_not_allowed() -> ApiError:
    return ApiError(405, "MethodNotAllowed",
                    "the server does not allow this method on the requested resource", {})


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")


def forbidden(user: str, verb: str, resource: str, sub: str | None, name: str | None,
              namespace: str | None) -> ApiError:
    what = resource + ("/" + sub if sub else "")
    if namespace:
        why = (f'User "{user}" cannot {verb} resource "{what}" in API group "" '
               f'in the namespace "{namespace}"')
    else:
        why = f'User "{user}" cannot {verb} resource "{what}" in API group "" at the cluster scope'
    subject = f'{resource} "{name}"' if name else resource
    return ApiError(403, "Forbidden", f"{subject} is forbidden: {why}", _details(resource, name))


def _fmt_value(value) -> str:
    """Formats a value roughly as the API server's field errors do (Go's %q for strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float, str)):
        return json.dumps(value)
    text = json.dumps(value, separators=(",", ":"))
    return text if len(text) <= 80 else text[:77] + "..."


class FieldError:
    """One field.Error: reason (FieldValueInvalid, ...), field path, value and detail."""

    def __init__(self, reason: str, field: str, value=None, detail: str = ""):
        self.reason = reason
        self.field = field
        self.value = value
        self.detail = detail

    def body(self) -> str:
        if self.reason == "FieldValueRequired":
            text = "Required value"
        elif self.reason == "FieldValueForbidden":
            text = "Forbidden"
        elif self.reason == "FieldValueDuplicate":
            text = f"Duplicate value: {_fmt_value(self.value)}"
        elif self.reason == "FieldValueNotSupported":
            text = f"Unsupported value: {_fmt_value(self.value)}"
        else:
            text = f"Invalid value: {_fmt_value(self.value)}"
        return f"{text}: {self.detail}" if self.detail else text


def required(field: str, detail: str = "") -> FieldError:
    return FieldError("FieldValueRequired", field, None, detail)


def invalid_value(field: str, value, detail: str) -> FieldError:
    return FieldError("FieldValueInvalid", field, value, detail)


def invalid_error(kind: str, name: str, errors: list[FieldError]) -> ApiError:
    parts = [f"{e.field}: {e.body()}" for e in errors]
    agg = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    causes = [{"reason": e.reason, "message": e.body(), "field": e.field} for e in errors]
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {agg}',
                    {"name": name, "kind": kind, "causes": causes})


# ---------------------------------------------------------------------------------------------
# Name, label and quantity syntax (apimachinery's validation rules)

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")

DNS1123_LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters "
                     "or '-', and must start and end with an alphanumeric character (e.g. 'my-name',"
                     "  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
DNS1123_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                         "characters, '-' or '.', and must start and end with an alphanumeric "
                         "character (e.g. 'example.com', regex used for validation is "
                         "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
QUALIFIED_NAME_MSG = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must "
                      "start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',"
                      "  or '123-abc', regex used for validation is "
                      "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
LABEL_VALUE_MSG = ("a valid label must be an empty string or consist of alphanumeric characters, "
                   "'-', '_' or '.', and must start and end with an alphanumeric character (e.g. "
                   "'MyValue',  or 'my_value',  or '12345', regex used for validation is "
                   "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")


def dns1123_label_errors(value: str) -> list[str]:
    errs = []
    if len(value) > 63:
        errs.append("must be no more than 63 characters")
    if not _DNS1123_LABEL.fullmatch(value):
        errs.append(DNS1123_LABEL_MSG)
    return errs


def dns1123_subdomain_errors(value: str) -> list[str]:
    errs = []
    if len(value) > 253:
        errs.append("must be no more than 253 characters")
    if not _DNS1123_SUBDOMAIN.fullmatch(value):
        errs.append(DNS1123_SUBDOMAIN_MSG)
    return errs


def qualified_name_errors(key: str) -> list[str]:
    parts = key.split("/")
    if len(parts) == 1:
        name = parts[0]
        errs = []
    elif len(parts) == 2:
        prefix, name = parts
        errs = ["prefix part must be non-empty"] if not prefix else \
            ["prefix part " + e for e in dns1123_subdomain_errors(prefix)]
    else:
        return ["a qualified name must consist of alphanumeric characters, '-', '_' or '.', and "
                "must start and end with an alphanumeric character, with an optional DNS "
                "subdomain prefix and '/' (e.g. 'example.com/MyName')"]
    if not name:
        errs.append("name part must be non-empty")
    else:
        if len(name) > 63:
            errs.append("name part must be no more than 63 characters")
        if not _QUALIFIED_NAME.fullmatch(name):
            errs.append(QUALIFIED_NAME_MSG)
    return errs


def label_value_errors(value: str) -> list[str]:
    errs = []
    if len(value) > 63:
        errs.append("must be no more than 63 characters")
    if not _LABEL_VALUE.fullmatch(value):
        errs.append(LABEL_VALUE_MSG)
    return errs


_QUANTITY = re.compile(r"([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)")
_SUFFIX = {
    "": 1, "n": fractions.Fraction(1, 10**9), "u": fractions.Fraction(1, 10**6),
    "m": fractions.Fraction(1, 1000), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
    "Ei": 2**60,
}
QUANTITY_MSG = "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"


def parse_quantity(value) -> fractions.Fraction:
    """Parses a resource.Quantity ("500m", "2", "64Gi", "1G", 1.5) exactly; ValueError if bad."""
    if isinstance(value, bool) or value is None:
        raise ValueError(QUANTITY_MSG)
    m = _QUANTITY.fullmatch(str(value).strip())
    if not m:
        raise ValueError(QUANTITY_MSG)
    number, suffix = m.groups()
    try:
        n = fractions.Fraction(decimal.Decimal(number))
    except (decimal.InvalidOperation, ValueError):
        raise ValueError(QUANTITY_MSG) from None
    if suffix in _SUFFIX:
        return n * _SUFFIX[suffix]
    if suffix[:1] in ("e", "E") and re.fullmatch(r"[-+]?[0-9]+", suffix[1:]):
        return n * fractions.Fraction(10) ** int(suffix[1:])
    raise ValueError(QUANTITY_MSG)


def is_extended_resource(name: str) -> bool:
    """cpu, memory, ephemeral-storage, hugepages-* and kubernetes.io/* are native; the rest extended."""
    if name in ("cpu", "memory", "ephemeral-storage", "storage", "pods") or \
            name.startswith("hugepages-"):
        return False
    if "/" not in name:
        return False
    prefix = name.split("/", 1)[0]
    return not (prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"))


# ---------------------------------------------------------------------------------------------
# Label and field selectors

_SELECTOR_SPECIAL = "=!(),<>"


def _lex_selector(text: str) -> list:
    tokens, i = [], 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif text.startswith("==", i) or text.startswith("!=", i):
            tokens.append(text[i:i + 2])
            i += 2
        elif c in _SELECTOR_SPECIAL:
            tokens.append(c)
            i += 1
        else:
            j = i
            while j < len(text) and not text[j].isspace() and text[j] not in _SELECTOR_SPECIAL:
                j += 1
            tokens.append(("id", text[i:j]))
            i = j
    return tokens


def _is_id(tok) -> bool:
    return isinstance(tok, tuple)


def _tok_text(tok) -> str:
    return tok[1] if _is_id(tok) else tok


def parse_label_selector(text: str) -> list[tuple[str, str, tuple]]:
    """Parses the full label selector syntax into (key, op, values) requirements (ANDed).

    op is one of "=", "!=", "in", "notin", "exists", "!", "<", ">". ApiError 400 if malformed.
    """
    tokens = _lex_selector(text or "")
    reqs: list[tuple[str, str, tuple]] = []
    pos = 0

    def fail(msg: str):
        raise bad_request(f"unable to parse requirement: {msg}")

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    if not tokens:
        return reqs
    while True:
        tok = peek()
        pos += 1
        if tok == "!":
            key = peek()
            pos += 1
            if not _is_id(key):
                fail(f"found '{_tok_text(key) if key else ''}', expected: identifier")
            req = (key[1], "!", ())
        elif _is_id(tok):
            key, nxt = tok[1], peek()
            if nxt is None or nxt == ",":
                req = (key, "exists", ())
            elif nxt in ("=", "==", "!="):
                pos += 1
                val = peek()
                if _is_id(val):
                    pos += 1
                    value = val[1]
                elif val is None or val == ",":
                    value = ""
                else:
                    fail(f"found '{val}', expected: identifier")
                req = (key, "!=" if nxt == "!=" else "=", (value,))
            elif nxt in ("<", ">"):
                pos += 1
                val = peek()
                pos += 1
                if not _is_id(val) or not re.fullmatch(r"-?[0-9]+", val[1]):
                    fail("for 'Gt', 'Lt' operators, the value must be an integer")
                req = (key, nxt, (val[1],))
            elif _is_id(nxt) and nxt[1] in ("in", "notin"):
                pos += 1
                if peek() != "(":
                    fail(f"found '{_tok_text(peek()) if peek() else ''}', expected: '('")
                pos += 1
                values: list[str] = []
                expect_value = True
                while True:
                    t = peek()
                    pos += 1
                    if t is None:
                        fail("found '', expected: ')'")
                    if t == ")":
                        if expect_value and values:
                            values.append("")
                        break
                    if t == ",":
                        if expect_value:
                            values.append("")
                        expect_value = True
                        continue
                    if not _is_id(t) or not expect_value:
                        fail(f"found '{_tok_text(t)}', expected: ',' or ')'")
                    values.append(t[1])
                    expect_value = False
                if not values:
                    fail("for 'in', 'notin' operators, values set can't be empty")
                req = (key, nxt[1], tuple(values))
            else:
                fail(f"found '{_tok_text(nxt)}', expected: in, notin, =, ==, !=, gt, lt")
        else:
            fail(f"found '{_tok_text(tok) if tok else ''}', expected: !, identifier, or 'end of string'")
        key_errs = qualified_name_errors(req[0])
        if key_errs:
            fail(f'key: Invalid value: "{req[0]}": {key_errs[0]}')
        if req[1] not in ("<", ">"):
            for v in req[2]:
                val_errs = label_value_errors(v)
                if val_errs:
                    fail(f'values[0][{req[0]}]: Invalid value: "{v}": {val_errs[0]}')
        reqs.append(req)
        tok = peek()
        pos += 1
        if tok is None:
            return reqs
        if tok != ",":
            fail(f"found '{_tok_text(tok)}', expected: ',' or 'end of string'")


def labels_match(reqs: list[tuple[str, str, tuple]], labels: dict | None) -> bool:
    labels = labels or {}
    for key, op, values in reqs:
        has = key in labels
        value = labels.get(key)
        if op == "=":
            ok = has and value == values[0]
        elif op == "!=":
            ok = not has or value != values[0]
        elif op == "in":
            ok = has and value in values
        elif op == "notin":
            ok = not has or value not in values
        elif op == "exists":
            ok = has
        elif op == "!":
            ok = not has
        else:
            try:
                ok = has and ((int(value) < int(values[0])) if op == "<"
                              else (int(value) > int(values[0])))
            except ValueError:
                ok = False
        if not ok:
            return False
    return True


def parse_field_selector(resource: str, text: str) -> list[tuple[str, bool, str]]:
    """Parses `f=v,f!=v` into (field, equal, value); ApiError 400 for unknown fields."""
    reqs = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"([^=!]+?)\s*(==|!=|=)\s*(.*)", part)
        if not m:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
        field, op, value = m.groups()
        if field not in FIELD_SELECTORS.get(resource, ()):
            raise bad_request(f'field label not supported: {field}')
        reqs.append((field, op != "!=", value))
    return reqs


def field_value(obj: dict, field: str) -> str:
    cur = obj
    for part in field.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    if field == "spec.unschedulable":
        return "true" if cur else "false"
    return "" if cur is None else str(cur)


def fields_match(reqs: list[tuple[str, bool, str]], obj: dict) -> bool:
    return all((field_value(obj, f) == v) == eq for f, eq, v in reqs)


# ---------------------------------------------------------------------------------------------
# Patches


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch (strategic merge patch is treated the same way)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise bad_request(f"invalid JSON pointer: {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc, parts: list[str]):
    cur = doc
    for p in parts:
        if isinstance(cur, dict) and p in cur:
            cur = cur[p]
        elif isinstance(cur, list) and p.isdigit() and int(p) < len(cur):
            cur = cur[int(p)]
        else:
            raise ApiError(422, "Invalid", f"the server rejected our request due to an error in "
                           f"our request: path /{'/'.join(parts)} does not exist")
    return cur


def json_patch(doc, ops):
    """RFC 6902 JSON patch: add, remove, replace, move, copy, test."""
    if not isinstance(ops, list):
        raise bad_request("json patch must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise bad_request(f"invalid json patch operation: {op!r}")
        kind, parts = op["op"], _pointer(op["path"])

        def add(parts, value):
            nonlocal doc
            if not parts:
                doc = value
                return
            parent = _walk(doc, parts[:-1])
            last = parts[-1]
            if isinstance(parent, list):
                if last == "-":
                    parent.append(value)
                elif last.isdigit() and int(last) <= len(parent):
                    parent.insert(int(last), value)
                else:
                    raise bad_request(f"invalid index {last!r}")
            elif isinstance(parent, dict):
                parent[last] = value
            else:
                raise bad_request(f"cannot add at {op['path']}")

        def remove(parts):
            parent = _walk(doc, parts[:-1])
            _walk(doc, parts)
            if isinstance(parent, list):
                return parent.pop(int(parts[-1]))
            return parent.pop(parts[-1])

        if kind == "add":
            add(parts, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            remove(parts)
        elif kind == "replace":
            remove(parts)
            add(parts, copy.deepcopy(op.get("value")))
        elif kind == "move":
            value = remove(_pointer(op.get("from", "")))
            add(parts, value)
        elif kind == "copy":
            add(parts, copy.deepcopy(_walk(doc, _pointer(op.get("from", "")))))
        elif kind == "test":
            if _walk(doc, parts) != op.get("value"):
                raise ApiError(422, "Invalid", f"the server rejected our request due to an error in "
                               f"our request: testing value {op['path']} failed")
        else:
            raise bad_request(f"unknown json patch operation {kind!r}")
    return doc


# ---------------------------------------------------------------------------------------------
# Schema validation (kubernetes-validate) and the checks the schema cannot make


def pick_schema_version(requested: str) -> str:
    """The schema version kubernetes-validate ships that is nearest to `requested` (x.y[.z])."""
    from kubernetes_validate.utils import all_versions

    shipped = all_versions()
    m = re.match(r"v?(\d+)\.(\d+)", requested)
    if not m:
        raise SystemExit(f"--kubernetes-version {requested!r} is not a version like 1.30.0")
    want = (int(m.group(1)), int(m.group(2)))

    def distance(v: str):
        major, minor = (int(x) for x in v.split(".")[:2])
        return (abs(major - want[0]) * 1000 + abs(minor - want[1]), -minor)

    return min(shipped, key=distance)


def _format_path(parts) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", p):
            out += ("." if out else "") + p
        else:
            out += f"[{p}]"
    return out


def _join(base: str, key: str) -> str:
    return _format_path([key]) if not base else \
        (base + ("." + key if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) else f"[{key}]"))


def schema_errors(obj: dict, version: str) -> list[FieldError]:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
        return []
    except kubernetes_validate.ValidationError as e:
        field = _format_path(list(e.absolute_path))
        if e.validator == "additionalProperties":
            known = set((e.schema or {}).get("properties", {}))
            extra = sorted(set(e.instance) - known) if isinstance(e.instance, dict) else []
            path = _join(field, extra[0] if extra else "?")
            return [FieldError("FieldValueForbidden", path, None,
                               f'unknown field "{path}" (not in the Kubernetes {version} schema)')]
        if e.validator == "required":
            m = re.match(r"'(.+?)' is a required property", e.message)
            return [required(_join(field, m.group(1)) if m else field)]
        if e.validator == "enum":
            allowed = ", ".join(json.dumps(v) for v in e.validator_value)
            return [FieldError("FieldValueNotSupported", field or "<root>", e.instance,
                               f"supported values: {allowed}")]
        if e.validator == "type":
            types = e.validator_value if isinstance(e.validator_value, list) else [e.validator_value]
            wanted = " or ".join(t for t in types if t != "null")
            return [invalid_value(field or "<root>", e.instance, f"must be of type {wanted}")]
        return [invalid_value(field or "<root>", e.instance, e.message)]


def _b64_error(text: str) -> str | None:
    """None when `text` is standard padded base64 (as Go decodes []byte); else Go's message."""
    cleaned = text.replace("\r", "").replace("\n", "")
    try:
        base64.b64decode(cleaned, validate=True)
        return None
    except (ValueError, TypeError):
        pass
    alphabet = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
    for i, c in enumerate(cleaned):
        if c not in alphabet:
            return f"illegal base64 data at input byte {i}"
    return f"illegal base64 data at input byte {len(cleaned)}"


def _canonical_quantity(value):
    """The API server always answers quantities as strings; numbers in requests become strings."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return format(decimal.Decimal(repr(value)).normalize(), "f")


def _image_pull_policy(image: str) -> str:
    if "@" in image:
        return "IfNotPresent"
    last = image.rsplit("/", 1)[-1]
    tag = last.split(":", 1)[1] if ":" in last else ""
    return "Always" if tag in ("", "latest") else "IfNotPresent"


def tolerates(tol: dict, taint: dict) -> bool:
    effect = tol.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    op = tol.get("operator") or "Equal"
    key = tol.get("key") or ""
    if not key:
        return op == "Exists"
    if key != taint.get("key"):
        return False
    if op == "Exists":
        return True
    return (tol.get("value") or "") == (taint.get("value") or "")


def default_pod(pod: dict) -> None:
    """The defaulting the API server (and its default admission plugins) applies to a Pod."""
    spec = pod.setdefault("spec", {})
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    account = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
    spec["serviceAccountName"] = account
    spec["serviceAccount"] = account
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("priority", 0)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    tolerations = spec.setdefault("tolerations", [])
    for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
        taint = {"key": key, "effect": "NoExecute"}
        if not any(isinstance(t, dict) and tolerates(t, taint) for t in tolerations):
            tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute",
                                "tolerationSeconds": 300})
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        c.setdefault("terminationMessagePath", "/dev/termination-log")
        c.setdefault("terminationMessagePolicy", "File")
        c.setdefault("imagePullPolicy", _image_pull_policy(c.get("image") or ""))
        res = c.setdefault("resources", {})
        for kind in ("limits", "requests"):
            if res.get(kind):
                res[kind] = {k: _canonical_quantity(v) for k, v in res[kind].items()}
        if res.get("limits"):
            requests = res.setdefault("requests", {})
            for k, v in res["limits"].items():
                requests.setdefault(k, v)


def pod_qos(pod: dict) -> str:
    containers = (pod["spec"].get("containers") or []) + (pod["spec"].get("initContainers") or [])
    any_set = False
    guaranteed = True
    for c in containers:
        res = c.get("resources") or {}
        limits, requests = res.get("limits") or {}, res.get("requests") or {}
        for r in ("cpu", "memory"):
            if r in limits or r in requests:
                any_set = True
            if r not in limits or requests.get(r, limits.get(r)) != limits.get(r):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def pod_requests(pod: dict) -> dict[str, fractions.Fraction]:
    """Effective requests: the sum over containers, at least the largest init container's."""
    total: dict[str, fractions.Fraction] = collections.defaultdict(fractions.Fraction)
    spec = pod["spec"]
    for c in spec.get("containers") or []:
        for name, v in ((c.get("resources") or {}).get("requests") or {}).items():
            total[name] += parse_quantity(v)
    for c in spec.get("initContainers") or []:
        for name, v in ((c.get("resources") or {}).get("requests") or {}).items():
            total[name] = max(total[name], parse_quantity(v))
    return dict(total)


def container_gpus(container: dict) -> int:
    value = ((container.get("resources") or {}).get("limits") or {}).get(GPU)
    return int(parse_quantity(value)) if value is not None else 0


def pod_gpus(pod: dict) -> int:
    return int(pod_requests(pod).get(GPU, 0))


def validate_meta(obj: dict, name_errors) -> list[FieldError]:
    md = obj["metadata"]
    errs = []
    name = md.get("name") or ""
    if not name:
        errs.append(required("metadata.name", "name or generateName is required"))
    else:
        errs += [invalid_value("metadata.name", name, e) for e in name_errors(name)]
    ns = md.get("namespace")
    if ns is not None:
        errs += [invalid_value("metadata.namespace", ns, e) for e in dns1123_label_errors(ns)]
    for key, value in (md.get("labels") or {}).items():
        errs += [invalid_value("metadata.labels", key, e) for e in qualified_name_errors(key)]
        errs += [invalid_value("metadata.labels", value, e) for e in label_value_errors(value)]
    annotations = md.get("annotations") or {}
    for key in annotations:
        errs += [invalid_value("metadata.annotations", key, e)
                 for e in qualified_name_errors(key.lower())]
    if sum(len(k) + len(v) for k, v in annotations.items()) > 256 * 1024:
        errs.append(FieldError("FieldValueTooLong", "metadata.annotations", None,
                               "Too long: must have at most 262144 bytes"))
    refs = md.get("ownerReferences") or []
    if sum(1 for r in refs if r.get("controller")) > 1:
        errs.append(invalid_value("metadata.ownerReferences", refs,
                                  "Only one reference can have Controller set to true"))
    for i, ref in enumerate(refs):
        for f in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(f):
                errs.append(required(f"metadata.ownerReferences[{i}].{f}"))
    return errs


FIELD_REF_PATHS = ("metadata.name", "metadata.namespace", "metadata.uid", "metadata.labels",
                   "metadata.annotations", "spec.nodeName", "spec.serviceAccountName",
                   "status.hostIP", "status.hostIPs", "status.podIP", "status.podIPs")
ENV_NAME_MSG = ("a valid environment variable name must consist of alphabetic characters, digits, "
                "'_', '-', or '.', and must not start with a digit (e.g. 'my.env-name',  or "
                "'MY_ENV.NAME',  or 'MyEnvName1', regex used for validation is "
                "'[-._a-zA-Z][-._a-zA-Z0-9]*')")


def _validate_env(c: dict, path: str) -> list[FieldError]:
    errs = []
    for i, e in enumerate(c.get("env") or []):
        fp = f"{path}.env[{i}]"
        name = e.get("name") or ""
        if not name:
            errs.append(required(fp + ".name"))
        elif not _ENV_NAME.fullmatch(name):
            errs.append(invalid_value(fp + ".name", name, ENV_NAME_MSG))
        vf = e.get("valueFrom")
        if vf is None:
            continue
        if e.get("value"):
            errs.append(invalid_value(fp + ".valueFrom", "",
                                      "may not be specified when `value` is not empty"))
        sources = [k for k in ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef")
                   if vf.get(k) is not None]
        if not sources:
            errs.append(invalid_value(fp + ".valueFrom", "", "must specify one of: `fieldRef`, "
                                      "`resourceFieldRef`, `configMapKeyRef` or `secretKeyRef`"))
        elif len(sources) > 1:
            errs.append(invalid_value(fp + ".valueFrom", "",
                                      "may not have more than one field specified at a time"))
        for src in ("secretKeyRef", "configMapKeyRef"):
            ref = vf.get(src)
            if ref is None:
                continue
            if not ref.get("name"):
                errs.append(required(f"{fp}.valueFrom.{src}.name"))
            key = ref.get("key") or ""
            if not key:
                errs.append(required(f"{fp}.valueFrom.{src}.key"))
            elif not _CONFIG_KEY.fullmatch(key):
                errs.append(invalid_value(f"{fp}.valueFrom.{src}.key", key,
                                          "a valid config key must consist of alphanumeric "
                                          "characters, '-', '_' or '.'"))
        ref = vf.get("fieldRef")
        if ref is not None:
            fpath = ref.get("fieldPath") or ""
            base = re.sub(r"\['[^']*'\]$", "", fpath)
            if base not in FIELD_REF_PATHS:
                allowed = ", ".join(json.dumps(p) for p in FIELD_REF_PATHS)
                errs.append(FieldError("FieldValueNotSupported", f"{fp}.valueFrom.fieldRef.fieldPath",
                                       fpath, f"supported values: {allowed}"))
    return errs


def _validate_resources(res: dict, path: str) -> list[FieldError]:
    errs = []
    limits, requests = res.get("limits") or {}, res.get("requests") or {}
    parsed = {}
    for kind, values in (("limits", limits), ("requests", requests)):
        for name, value in values.items():
            fp = f"{path}.{kind}[{name}]"
            try:
                q = parse_quantity(value)
            except ValueError as e:
                errs.append(invalid_value(fp, value, str(e)))
                continue
            if q < 0:
                errs.append(invalid_value(fp, value, "must be greater than or equal to 0"))
            if is_extended_resource(name) and q.denominator != 1:
                errs.append(invalid_value(fp, value, "must be an integer"))
            parsed[(kind, name)] = q
    for name, value in requests.items():
        if is_extended_resource(name):
            if name not in limits:
                errs.append(required(f"{path}.limits",
                                     "Limit must be set for non overcommitable resources"))
            elif ("requests", name) in parsed and ("limits", name) in parsed and \
                    parsed[("requests", name)] != parsed[("limits", name)]:
                errs.append(invalid_value(f"{path}.requests[{name}]", value,
                                          f"must be equal to {name} limit of {limits[name]}"))
        elif name in limits and ("requests", name) in parsed and ("limits", name) in parsed and \
                parsed[("requests", name)] > parsed[("limits", name)]:
            errs.append(invalid_value(f"{path}.requests[{name}]", value,
                                      f"must be less than or equal to {name} limit of {limits[name]}"))
    return errs


def validate_pod(pod: dict) -> list[FieldError]:
    errs = validate_meta(pod, dns1123_subdomain_errors)
    spec = pod["spec"]
    containers = spec.get("containers") or []
    if not containers:
        errs.append(required("spec.containers"))
    seen = set()
    for group in ("containers", "initContainers"):
        for i, c in enumerate(spec.get(group) or []):
            p = f"spec.{group}[{i}]"
            name = c.get("name") or ""
            if not name:
                errs.append(required(p + ".name"))
            else:
                errs += [invalid_value(p + ".name", name, e) for e in dns1123_label_errors(name)]
                if name in seen:
                    errs.append(FieldError("FieldValueDuplicate", p + ".name", name))
                seen.add(name)
            if not c.get("image"):
                errs.append(required(p + ".image"))
            errs += _validate_env(c, p)
            errs += _validate_resources(c.get("resources") or {}, p + ".resources")
            errs += _validate_proc_mount(c, p, spec)
    policy = spec.get("restartPolicy")
    if policy not in ("Always", "OnFailure", "Never"):
        errs.append(FieldError("FieldValueNotSupported", "spec.restartPolicy", policy,
                               'supported values: "Always", "OnFailure", "Never"'))
    for key, value in (spec.get("nodeSelector") or {}).items():
        errs += [invalid_value("spec.nodeSelector", key, e) for e in qualified_name_errors(key)]
        errs += [invalid_value("spec.nodeSelector", value, e) for e in label_value_errors(value)]
    for i, t in enumerate(spec.get("tolerations") or []):
        p = f"spec.tolerations[{i}]"
        op = t.get("operator") or "Equal"
        key = t.get("key") or ""
        if op not in ("Equal", "Exists"):
            errs.append(FieldError("FieldValueNotSupported", p + ".operator", op,
                                   'supported values: "Equal", "Exists"'))
        if op == "Exists" and t.get("value"):
            errs.append(invalid_value(p + ".operator", t.get("value"),
                                      "value must be empty when `operator` is 'Exists'"))
        if not key and op != "Exists":
            errs.append(invalid_value(p + ".operator", op, "operator must be Exists when `key` is "
                                      "empty, which means \"match all values and all keys\""))
        if key:
            errs += [invalid_value(p + ".key", key, e) for e in qualified_name_errors(key)]
        effect = t.get("effect") or ""
        if effect not in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            errs.append(FieldError("FieldValueNotSupported", p + ".effect", effect,
                                   'supported values: "NoSchedule", "PreferNoSchedule", "NoExecute"'))
    deadline = spec.get("activeDeadlineSeconds")
    if deadline is not None and not 1 <= deadline <= 2147483647:
        errs.append(invalid_value("spec.activeDeadlineSeconds", deadline,
                                  "must be between 1 and 2147483647, inclusive"))
    grace = spec.get("terminationGracePeriodSeconds")
    if grace is not None and grace < 0:
        errs.append(invalid_value("spec.terminationGracePeriodSeconds", grace,
                                  "must be greater than or equal to 0"))
    if spec.get("hostUsers") is False:
        # validateHostUsers (pkg/apis/core/validation): no other host namespace with a user
        # namespace of the pod's own. The field names are upstream's, capitals included.
        for field, name in (("hostNetwork", "hostNetwork"), ("hostPID", "HostPID"),
                            ("hostIPC", "HostIPC")):
            if spec.get(field):
                errs.append(FieldError("FieldValueForbidden", f"spec.{name}", None,
                                       "when `pod.Spec.HostUsers` is false"))
    return errs


def _validate_proc_mount(c: dict, path: str, spec: dict) -> list[FieldError]:
    """securityContext.procMount (pkg/apis/core/validation, ProcMountType): Default or
    Unmasked, and Unmasked only in a pod with a user namespace of its own (hostUsers: false).
    Validated as by an API server with the ProcMountType and UserNamespacesSupport feature
    gates on (the default from Kubernetes 1.33); an older one with them off drops both fields."""
    pm = (c.get("securityContext") or {}).get("procMount")
    field = path + ".securityContext.procMount"
    if pm is None:
        return []
    if pm not in ("Default", "Unmasked"):
        return [FieldError("FieldValueNotSupported", field, pm,
                           'supported values: "Default", "Unmasked"')]
    if pm == "Unmasked" and spec.get("hostUsers") is not False:
        return [invalid_value(field, pm, "`hostUsers` must be false to use `Unmasked`")]
    return []


def validate_secret(secret: dict) -> list[FieldError]:
    errs = validate_meta(secret, dns1123_subdomain_errors)
    total = 0
    for key, value in (secret.get("data") or {}).items():
        if not _CONFIG_KEY.fullmatch(key) or len(key) > 253:
            errs.append(invalid_value(f"data[{key}]", key, "a valid config key must consist of "
                                      "alphanumeric characters, '-', '_' or '.' (e.g. 'key.name', "
                                      " or 'KEY_NAME',  or 'key-name', regex used for validation "
                                      "is '[-._a-zA-Z0-9]+')"))
        problem = _b64_error(value)
        if problem:
            errs.append(invalid_value(f"data[{key}]", "<secret contents redacted>", problem))
        else:
            total += len(base64.b64decode(value.replace("\r", "").replace("\n", "")))
    if total > 1024 * 1024:
        errs.append(FieldError("FieldValueTooLong", "data", None,
                               "Too long: must have at most 1048576 bytes"))
    return errs


# ---------------------------------------------------------------------------------------------
# Nodes


NODE_KEYS = {"name", "labels", "taints", "gpus", "gpu_uuids", "cpu", "memory", "runtime_classes",
             "device_plugin"}

# How the node's device plugin hands a container its GPUs (README, "Starting the container"):
# each acts out one documented mechanism; the pod's `/dev` and `/var/run` are a directory of the
# pod's own, announced as GPUCI_GRANT_ROOT, since a pod here is a local process.
DEVICE_PLUGINS = ("envvar-uuid", "envvar-index", "volume-mounts", "volume-mounts-index", "cdi", "gke")
VOLUME_MOUNTS_DIR = "/var/run/nvidia-container-devices"


def node_config(raw) -> dict:
    """Validates one node entry of NODES.json (or a POST /_test/nodes body). ValueError if bad."""
    if not isinstance(raw, dict):
        raise ValueError("a node must be a JSON object")
    unknown = sorted(set(raw) - NODE_KEYS)
    if unknown:
        raise ValueError(f"unknown node field(s) {unknown}; known: {sorted(NODE_KEYS)}")
    name = raw.get("name")
    if not isinstance(name, str) or dns1123_subdomain_errors(name):
        raise ValueError(f"node name {name!r} is not a DNS-1123 subdomain")
    gpus = raw.get("gpus", 0)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
        raise ValueError(f"node {name}: gpus must be a whole number, got {gpus!r}")
    uuids = raw.get("gpu_uuids")
    if uuids is None:
        uuids = [f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'gpuci-testserver/{name}/{i}')}"
                 for i in range(gpus)]
    if not isinstance(uuids, list) or len(uuids) != gpus or len(set(uuids)) != gpus or \
            not all(isinstance(u, str) and u for u in uuids):
        raise ValueError(f"node {name}: gpu_uuids must list {gpus} distinct strings")
    cpu, memory = str(raw.get("cpu", "16")), str(raw.get("memory", "64Gi"))
    for what, value in (("cpu", cpu), ("memory", memory)):
        try:
            parse_quantity(value)
        except ValueError:
            raise ValueError(f"node {name}: {what} {value!r} is not a quantity") from None
    labels = raw.get("labels") or {}
    if not isinstance(labels, dict) or any(qualified_name_errors(k) or not isinstance(v, str)
                                           or label_value_errors(v) for k, v in labels.items()):
        raise ValueError(f"node {name}: labels must map label keys to label values")
    taints = raw.get("taints") or []
    for t in taints:
        if not isinstance(t, dict) or not t.get("key") or \
                t.get("effect") not in ("NoSchedule", "PreferNoSchedule", "NoExecute") or \
                set(t) - {"key", "value", "effect"}:
            raise ValueError(f"node {name}: taint {t!r} needs key, effect (NoSchedule, "
                             "PreferNoSchedule or NoExecute) and optional value")
    plugin = raw.get("device_plugin", "envvar-uuid")
    if plugin not in DEVICE_PLUGINS:
        raise ValueError(f"node {name}: device_plugin {plugin!r} is not one of {list(DEVICE_PLUGINS)}")
    classes = raw.get("runtime_classes", ["nvidia"])
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise ValueError(f"node {name}: runtime_classes must be a list of names")
    return {"name": name, "labels": dict(labels), "taints": [dict(t) for t in taints],
            "gpus": gpus, "gpu_uuids": list(uuids), "cpu": cpu, "memory": memory,
            "runtime_classes": list(classes), "has_gpu_key": "gpus" in raw,
            "device_plugin": plugin}


def node_object(cfg: dict, kubelet_version: str) -> dict:
    name = cfg["name"]
    now = now_rfc3339()
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
              "kubernetes.io/arch": "amd64", "beta.kubernetes.io/os": "linux",
              "beta.kubernetes.io/arch": "amd64"}
    labels.update(cfg["labels"])
    capacity = {"cpu": cfg["cpu"], "memory": cfg["memory"], "ephemeral-storage": "100Gi",
                "pods": str(MAX_PODS_PER_NODE)}
    if cfg["gpus"] or cfg["has_gpu_key"]:
        capacity[GPU] = str(cfg["gpus"])
    spec = {"podCIDR": "10.244.0.0/24", "podCIDRs": ["10.244.0.0/24"]}
    if cfg["taints"]:
        spec["taints"] = cfg["taints"]
    metadata_extra = {}
    if cfg["gpu_uuids"]:
        metadata_extra["annotations"] = {"testserver.gpuci/gpu-uuids": ",".join(cfg["gpu_uuids"])}

    def cond(kind: str, status: str, reason: str, message: str) -> dict:
        return {"type": kind, "status": status, "lastHeartbeatTime": now,
                "lastTransitionTime": now, "reason": reason, "message": message}

    return {
        "kind": "Node", "apiVersion": "v1",
        "metadata": {"name": name, "uid": str(uuid.uuid4()), "creationTimestamp": now,
                     "labels": labels, **metadata_extra},
        "spec": spec,
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory",
                     "kubelet has sufficient memory available"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure",
                     "kubelet has no disk pressure"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID",
                     "kubelet has sufficient PID available"),
                cond("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
            ],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": uuid.uuid5(uuid.NAMESPACE_URL, "machine/" + name).hex,
                "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_URL, "system/" + name)),
                "bootID": str(uuid.uuid5(uuid.NAMESPACE_URL, "boot/" + name)),
                "kernelVersion": "6.1.0-simulated", "osImage": "gpuci kube-testserver (simulated)",
                "containerRuntimeVersion": "containerd://1.7.0-simulated",
                "kubeletVersion": kubelet_version, "kubeProxyVersion": kubelet_version,
                "operatingSystem": "linux", "architecture": "amd64",
            },
        },
    }


def node_selector_term_matches(term: dict, node: dict) -> bool:
    exprs = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not exprs and not fields:
        return False
    labels = node["metadata"].get("labels") or {}
    for e in exprs:
        if not _expr_matches(e, labels):
            return False
    for e in fields:
        if e.get("key") != "metadata.name" or \
                not _expr_matches(e, {"metadata.name": node["metadata"]["name"]}):
            return False
    return True


def _expr_matches(expr: dict, labels: dict) -> bool:
    key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
    has, value = key in labels, labels.get(key)
    if op == "In":
        return has and value in values
    if op == "NotIn":
        return not has or value not in values
    if op == "Exists":
        return has
    if op == "DoesNotExist":
        return not has
    if op in ("Gt", "Lt") and has and values:
        try:
            return int(value) > int(values[0]) if op == "Gt" else int(value) < int(values[0])
        except ValueError:
            return False
    return False


# ---------------------------------------------------------------------------------------------
# Pod processes

try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None
_PR_SET_PDEATHSIG = 1
_SIGKILL = int(signal.SIGKILL)


def _child_setup(cgroups: list[str] = ()) -> None:
    """Runs in the forked pod process: die with the server even if it is SIGKILLed, and (for a
    plain process) join the pod's cgroups before anything else runs."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, _SIGKILL)
    for d in cgroups:
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


WATCHDOG_SOURCE = r"""
import os, signal, sys, time
groups, cgroups = set(), []
for line in sys.stdin:
    kind, arg = line[:1], line[1:].rstrip("\n")
    if kind == "+":
        groups.add(int(arg))
    elif kind == "-":
        groups.discard(int(arg))
    elif kind == "c":
        cgroups.append(arg)
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
# Pod cgroups (deepest first), then their parents: empty once the kernel has reaped the pods.
deadline = time.monotonic() + 3
for d in sorted(set(cgroups), key=len, reverse=True):
    while True:
        try:
            os.rmdir(d)
        except FileNotFoundError:
            pass
        except OSError:
            if os.path.basename(d) != "kube-double" and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
        break
"""


class Watchdog:
    """A tiny separate process that SIGKILLs every live pod process group once the server is gone,
    then removes the pod cgroups it was told of.

    The server tells it each group it starts (+pgid) and reaps (-pgid) over a pipe. When the server
    dies in any way, SIGKILL included, the pipe closes and the watchdog kills what is left and exits.
    (PR_SET_PDEATHSIG alone would only reach each pod's top process, not its children.)
    """

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        try:
            self.proc = subprocess.Popen([sys.executable, "-S", "-c", WATCHDOG_SOURCE],
                                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True,
                                         close_fds=True)
        except OSError as e:
            LOG.warning("could not start the pod watchdog (%s); pod processes may outlive a "
                        "SIGKILLed server", e)

    def _send(self, line: str) -> None:
        if self.proc is None or self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            LOG.warning("the pod watchdog is gone")
            self.proc = None

    def add(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def cgroup(self, path: str) -> None:
        """A cgroup directory to remove once the pods are killed (if it is still there)."""
        self._send(f"c{path}\n")

    def remove(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(proc: subprocess.Popen) -> int | None:
    """The container exit code once the process has exited, else None.

    While the exited leader is still a zombie its process group id cannot be reused, so the group
    is swept with SIGKILL first (as tearing down a container's cgroup would), then it is reaped.
    """
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        info = "gone"
    if info is None:
        return None
    if info != "gone":
        _kill_group(proc.pid, signal.SIGKILL)
    proc.wait()
    rc = proc.returncode if proc.returncode is not None else 255
    return 128 - rc if rc < 0 else rc


def expand_vars(text: str, env: dict) -> str:
    """The kubelet's $(VAR) expansion: known names are replaced, $$ escapes a dollar."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i):
            j = text.find(")", i + 2)
            if j == -1:
                out.append(text[i:])
                break
            name = text[i + 2:j]
            out.append(env[name] if name in env else text[i:j + 1])
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# What the kubelet and containerd make of a container's security settings (pod_runtime.py acts
# it out). Sources: README.md, "Containers".

POD_RUNTIME = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pod_runtime.py")
# kubelet pkg/securitycontext/util.go (defaultMaskedPaths, defaultReadonlyPaths; "must be kept
# in sync with moby/moby"); ConvertToRuntimeMaskedPaths gives both empty for procMount Unmasked.
MASKED_PATHS = ("/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
                "/sys/firmware", "/sys/devices/virtual/powercap")
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
# containerd pkg/oci/spec.go defaultUnixCaps (the same 14 as Docker's): a container's bounding set.
DEFAULT_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
                "CAP_NET_RAW", "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
                "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE")
ALL_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
            "CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE",
            "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW",
            "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
            "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
            "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
            "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE",
            "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ",
            "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE")
USERNS_FIRST = 100000   # host id of the first pod's uid 0; each pod gets the next 65536
USERNS_SIZE = 65536
USERNS_SLOTS = 1000


def container_capabilities(sc: dict) -> list[str]:
    """containerd's CRI WithCapabilities: the default set; add ALL, then drop ALL, then the
    named adds, then the named drops (names without `CAP_`, any case)."""
    caps = (sc or {}).get("capabilities") or {}
    add = [str(c).upper() for c in caps.get("add") or []]
    drop = [str(c).upper() for c in caps.get("drop") or []]
    have = set(DEFAULT_CAPS)
    if "ALL" in add:
        have = set(ALL_CAPS)
    if "ALL" in drop:
        have = set()
    have |= {"CAP_" + c for c in add if c != "ALL"}
    have -= {"CAP_" + c for c in drop if c != "ALL"}
    return sorted(have)


def container_security(pod: dict, container: dict) -> dict:
    """How the container is to be run, from the pod's `hostUsers` and the container's
    securityContext: privileged (a plain process), else namespaces with a user namespace or
    not, masked paths or not (procMount), and the capability bounding set."""
    sc = container.get("securityContext") or {}
    host_users = pod["spec"].get("hostUsers") is not False
    unmasked = sc.get("procMount") == "Unmasked"
    return {"privileged": bool(sc.get("privileged")), "userns": not host_users,
            "masked": not unmasked, "capabilities": container_capabilities(sc)}


def _chown_tree(top: str, uid: int) -> None:
    """The kubelet's volumes, as a pod with its own user namespace sees them: owned by its root.
    (The kubelet idmap-mounts them; the double owns the files to the pod's host id instead.)"""
    os.lchown(top, uid, uid)
    for parent, dirs, files in os.walk(top):
        for n in dirs + files:
            os.lchown(os.path.join(parent, n), uid, uid)


class PodCgroups:
    """Each pod's own memory and pids cgroup, under the test server's own:
    `<mount>/<the server's cgroup>/kube-double/<pod uid>`, as the kubelet gives every container
    one (kubepods/…/pod<uid>/<container>), with the container's memory limit written, so an
    agent inside reads its container's limit from its own cgroup. Not available where the
    hierarchy is not writable: then pods run in the server's cgroup (logged at start)."""

    def __init__(self, mounts: str, own: str):
        self.v2 = False
        self.bases: list[str] = []
        self.why_not: str | None = None
        v1: dict[str, str] = {}
        unified = None
        for line in mounts.splitlines():
            f = line.split()
            if len(f) < 4:
                continue
            if f[2] == "cgroup":
                for c in ("memory", "pids"):
                    if c in f[3].split(",") and c not in v1:
                        v1[c] = f[1]
            elif f[2] == "cgroup2" and unified is None:
                unified = f[1]

        def own_path(ctrl: str | None) -> str:
            for entry in own.splitlines():
                parts = entry.split(":", 2)
                if len(parts) == 3 and (parts[1] == "" if ctrl is None
                                        else ctrl in parts[1].split(",")):
                    return parts[2].lstrip("/")
            return ""

        try:
            if "memory" in v1:
                self.bases = [os.path.join(v1[c], own_path(c), "kube-double")
                              for c in ("memory", "pids") if c in v1]
                for b in self.bases:
                    os.makedirs(b, exist_ok=True)
            elif unified is not None:
                with open(os.path.join(unified, "cgroup.controllers")) as f:
                    if "memory" not in f.read().split():
                        raise OSError("cgroup v2 without the memory controller")
                own_dir = os.path.join(unified, own_path(None))
                base = os.path.join(own_dir, "kube-double")
                os.makedirs(base, exist_ok=True)
                for d in (own_dir, base):
                    with open(os.path.join(d, "cgroup.subtree_control"), "w") as f:
                        f.write("+memory +pids")
                self.v2, self.bases = True, [base]
            else:
                raise OSError("no cgroup memory controller is mounted")
        except OSError as e:
            self.why_not = str(e)
            self.bases = []

    def create(self, uid: str, memory_limit: int | None) -> list[str]:
        """The pod's cgroup directories with its limit written (pids.max stays `max`)."""
        dirs = []
        for b in self.bases:
            d = os.path.join(b, uid)
            os.makedirs(d, exist_ok=True)   # recreates `kube-double` if another server removed it
            dirs.append(d)
            limit_file = "memory.max" if self.v2 else "memory.limit_in_bytes"
            if memory_limit is not None and os.path.exists(os.path.join(d, limit_file)):
                with open(os.path.join(d, limit_file), "w") as f:
                    f.write(str(memory_limit))
        return dirs

    def remove_bases(self) -> None:
        for b in self.bases:
            try:
                os.rmdir(b)
            except OSError:
                pass   # another test server in the same cgroup still has pods there


class ConfigError(Exception):
    """A container cannot be configured yet (CreateContainerConfigError)."""


EVICTED_MESSAGE = "The node was low on resource: memory. "
DEADLINE_MESSAGE = "Pod was active on the node longer than the specified deadline"
COND_ORDER = ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady",
              "PodScheduled", "DisruptionTarget")
NOT_CHANGEABLE_MSG = ("pod updates may not change fields other than `spec.containers[*].image`,"
                      "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,"
                      "`spec.tolerations` (only additions to existing tolerations),"
                      "`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was "
                      "previously negative)")


def set_condition(status: dict, kind: str, value: str, reason: str | None = None,
                  message: str | None = None) -> None:
    conds = status.setdefault("conditions", [])
    old = next((c for c in conds if c.get("type") == kind), None)
    cond = {"type": kind, "status": value, "lastProbeTime": None,
            "lastTransitionTime": old["lastTransitionTime"]
            if old and old.get("status") == value and old.get("lastTransitionTime")
            else now_rfc3339()}
    if reason:
        cond["reason"] = reason
    if message:
        cond["message"] = message
    conds[:] = [c for c in conds if c.get("type") != kind] + [cond]
    conds.sort(key=lambda c: COND_ORDER.index(c["type"]) if c["type"] in COND_ORDER else 99)


class PodRuntime:
    """What the simulated kubelet knows about a pod it has admitted."""

    def __init__(self, uid: str, admitted: float):
        self.uid = uid
        self.admitted = admitted          # monotonic; activeDeadlineSeconds counts from here
        self.proc: subprocess.Popen | None = None
        self.started_at: str | None = None
        self.container_id = ""
        self.restarts = 0
        self.last_state: dict = {}
        self.next_try = admitted + TICK   # first start attempt on the next kubelet pass
        self.pull_failed_at: float | None = None
        self.stop_reason: str | None = None   # "delete", "evict" or "deadline"
        self.kill_at: float | None = None     # monotonic time to SIGKILL the process group
        self.propagation = "Background"
        self.log_started = False
        self.namespaced = False   # run by pod_runtime.py (else a plain process: privileged)
        self.status_fd: int | None = None   # pod_runtime.py's report: "ok" or "error: why"
        self.status = b""
        self.starting = False     # started, not yet reported executing (ContainerCreating)
        self.cgroups: list[str] = []
        self.userns_slot: int | None = None


class Cluster:
    """All state, behind one lock and condition variable (self.cond).

    Stored objects are never mutated in place: a change deep-copies, edits and stores the copy,
    so the watch history and readers that serialize outside the lock see consistent snapshots.
    """

    def __init__(self, *, schema_version: str, kubernetes_version: str, log_dir: str,
                 rbac_rules: list | None, rbac_user: str, history_limit: int = HISTORY_LIMIT,
                 runtime_classes: set | None = None):
        self.cond = threading.Condition(threading.RLock())
        # The cluster's RuntimeClass objects, when given (--runtime-classes): a pod naming
        # another is refused at admission. None: every name is accepted (the scheduler still
        # matches it against the nodes' runtime_classes).
        self.runtime_classes = runtime_classes
        self.schema_version = schema_version
        self.kubernetes_version = kubernetes_version
        self.log_dir = log_dir
        self.rbac_rules = rbac_rules
        self.rbac_user = rbac_user
        self.port = 0
        self.started = now_rfc3339()
        # Milliseconds since the epoch: a restarted server never reuses an earlier one's
        # resourceVersions, so a client resuming from an old server's version gets 410 and re-lists.
        self.initial_rv = int(time.time() * 1000)
        self.rv = self.initial_rv
        self.objects: dict[str, dict] = {"pods": {}, "secrets": {}, "nodes": {}}
        self.history: collections.deque = collections.deque()
        self.history_floor = self.rv
        self.history_limit = history_limit
        self.node_cfg: dict[str, dict] = {}
        self.runtimes: dict[str, PodRuntime] = {}
        self.orphans: list[subprocess.Popen] = []
        self.watchdog: Watchdog | None = None
        self.requests: list[dict] = []
        self.order: dict[str, int] = {}
        self.seq = itertools.count()
        self.stopping = False
        self.pod_cgroups: PodCgroups | None = None   # set by main(); None: no pod cgroups
        self.cgroup_trash: set[str] = set()   # pod cgroups to remove once their processes are gone
        self.userns_used: set[int] = set()    # user namespace ranges held by pods
        # Namespaces, mounts and id maps need root; otherwise every pod is a plain process.
        self.namespaces = os.geteuid() == 0

    # -- store primitives; the caller holds self.cond --------------------------------------

    def _commit(self, resource: str, key: tuple, old: dict | None, new: dict, etype: str) -> dict:
        self.rv += 1
        new["metadata"]["resourceVersion"] = str(self.rv)
        if etype == "DELETED":
            self.objects[resource].pop(key, None)
        else:
            self.objects[resource][key] = new
        self.history.append((self.rv, etype, resource, old, new))
        while len(self.history) > self.history_limit:
            self.history_floor = self.history.popleft()[0]
        self.cond.notify_all()
        return new

    def _modify(self, resource: str, key: tuple, fn) -> dict | None:
        old = self.objects[resource].get(key)
        if old is None:
            return None
        new = copy.deepcopy(old)
        fn(new)
        if new == old:
            return old
        return self._commit(resource, key, old, new, "MODIFIED")

    def _delete_object(self, resource: str, key: tuple, orphan: bool = False) -> dict:
        old = self.objects[resource][key]
        gone = self._commit(resource, key, old, copy.deepcopy(old), "DELETED")
        self._collect_garbage(old["metadata"]["uid"], orphan)
        return gone

    def _live_uids(self) -> set:
        return {o["metadata"]["uid"] for objs in self.objects.values() for o in objs.values()}

    def _collect_garbage(self, owner_uid: str, orphan: bool) -> None:
        """The garbage collector, for secrets owned (metadata.ownerReferences) by a removed object."""
        live = self._live_uids()
        for key, secret in sorted(self.objects["secrets"].items()):
            refs = secret["metadata"].get("ownerReferences") or []
            if not any(r.get("uid") == owner_uid for r in refs):
                continue
            remaining = [r for r in refs if r.get("uid") != owner_uid]
            if orphan or any(r.get("uid") in live for r in remaining):
                def strip(o, remaining=remaining):
                    if remaining:
                        o["metadata"]["ownerReferences"] = remaining
                    else:
                        o["metadata"].pop("ownerReferences", None)
                self._modify("secrets", key, strip)
            elif key in self.objects["secrets"]:
                LOG.info("garbage collector: deleting secret %s/%s, its owner %s is gone",
                         key[0], key[1], owner_uid)
                self._delete_object("secrets", key)

    def record_request(self, entry: dict) -> None:
        with self.cond:
            self.requests.append(entry)

    # -- API operations --------------------------------------------------------------------

    def _check_body(self, resource: str, body, ns: str | None, name: str | None = None) -> dict:
        kind = KINDS[resource]
        if not isinstance(body, dict):
            raise bad_request(f"the body of the request must be a {kind} object")
        if body.get("apiVersion") not in (None, "", "v1"):
            raise bad_request(f"the API version in the data ({body.get('apiVersion')}) does not "
                              "match the expected API version (v1)")
        if body.get("kind") not in (None, "", kind):
            raise bad_request(f'{body.get("kind")} in version "v1" cannot be handled as a {kind}: '
                              f'the kind in the data does not match the expected kind ({kind})')
        obj = {"kind": kind, "apiVersion": "v1"}
        obj.update({k: copy.deepcopy(v) for k, v in body.items() if k not in ("kind", "apiVersion")})
        md = obj.get("metadata")
        if md is None:
            md = obj["metadata"] = {}
        if not isinstance(md, dict):
            raise bad_request("metadata must be an object")
        obj = {"kind": kind, "apiVersion": "v1", "metadata": md,
               **{k: v for k, v in obj.items() if k not in ("kind", "apiVersion", "metadata")}}
        if ns is not None:
            if md.get("namespace") not in (None, "", ns):
                raise bad_request("the namespace of the provided object does not match the "
                                  "namespace sent on the request")
            md["namespace"] = ns
        if name is not None and md.get("name") not in (None, "", name):
            raise bad_request(f"the name of the object ({md.get('name')}) does not match the name "
                              f"on the URL ({name})")
        return obj

    def _reject(self, kind: str, name: str, errors: list[FieldError]) -> None:
        err = invalid_error(kind, name, errors)
        LOG.warning("validation failed: %s", err.message)
        raise err

    def create(self, resource: str, ns: str, body, dry_run: bool = False) -> dict:
        if resource not in ("pods", "secrets"):
            raise method_not_allowed()
        kind = KINDS[resource]
        obj = self._check_body(resource, body, ns)
        md = obj["metadata"]
        if md.get("resourceVersion"):
            raise bad_request("resourceVersion should not be set on objects to be created")
        for f in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds",
                  "generation", "managedFields", "selfLink"):
            md.pop(f, None)
        if not md.get("name") and md.get("generateName"):
            md["name"] = md["generateName"] + "".join(random.choice(NAME_CHARS) for _ in range(5))
        name = md.get("name") or ""
        if resource == "pods":
            obj.pop("status", None)
        errs = schema_errors(obj, self.schema_version)
        if not errs:
            if resource == "secrets":
                self._fold_string_data(obj)
                errs = validate_secret(obj)
            else:
                default_pod(obj)
                errs = validate_pod(obj)
        if errs:
            self._reject(kind, name, errs)
        rc = obj.get("spec", {}).get("runtimeClassName") if resource == "pods" else None
        if rc is not None and self.runtime_classes is not None and rc not in self.runtime_classes:
            # The RuntimeClass admission plugin (plugin/pkg/admission/runtimeclass) refuses a
            # pod naming a RuntimeClass that does not exist with admission.NewForbidden:
            # 403 Forbidden, `pods "x" is forbidden: pod rejected: RuntimeClass "nvidia" not
            # found`. Written from the upstream source as remembered, not copied from a live
            # cluster's answer.
            raise ApiError(403, "Forbidden",
                           f'pods "{name}" is forbidden: pod rejected: RuntimeClass "{rc}" not found',
                           _details("pods", name))
        md["uid"] = str(uuid.uuid4())
        md["creationTimestamp"] = now_rfc3339()
        md["generation"] = 1
        if resource == "pods":
            obj["status"] = {"phase": "Pending", "qosClass": pod_qos(obj)}
        with self.cond:
            if (ns, name) in self.objects[resource]:
                raise already_exists(resource, name)
            if dry_run:
                return obj
            self.order[md["uid"]] = next(self.seq)
            LOG.info("created %s %s/%s", resource, ns, name)
            return self._commit(resource, (ns, name), None, obj, "ADDED")

    @staticmethod
    def _fold_string_data(secret: dict) -> None:
        string_data = secret.pop("stringData", None) or {}
        if string_data:
            data = dict(secret.get("data") or {})
            for k, v in string_data.items():
                data[k] = base64.b64encode(v.encode()).decode()
            secret["data"] = data
        secret.setdefault("type", "Opaque")

    def get(self, resource: str, ns: str | None, name: str) -> dict:
        with self.cond:
            obj = self.objects[resource].get((ns or "", name))
        if obj is None:
            raise not_found(resource, name)
        return obj

    def namespace(self, name: str) -> dict:
        if dns1123_label_errors(name):
            raise not_found("namespaces", name)
        return {"kind": "Namespace", "apiVersion": "v1",
                "metadata": {"name": name,
                             "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, "namespace/" + name)),
                             "resourceVersion": str(self.initial_rv),
                             "creationTimestamp": self.started,
                             "labels": {"kubernetes.io/metadata.name": name}},
                "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}

    def _matching(self, resource: str, ns: str | None, lsel, fsel) -> list[dict]:
        out = [o for (ons, _), o in sorted(self.objects[resource].items())
               if (ns is None or ons == ns) and labels_match(lsel, o["metadata"].get("labels"))
               and fields_match(fsel, o)]
        return out

    def list(self, resource: str, ns: str | None, query: dict) -> dict:
        lsel = parse_label_selector(query.get("labelSelector", ""))
        fsel = parse_field_selector(resource, query.get("fieldSelector", ""))
        try:
            limit = int(query.get("limit") or 0)
            if limit < 0:
                raise ValueError
        except ValueError:
            raise bad_request(f"invalid limit: {query.get('limit')!r}") from None
        start_after, token_rv = None, None
        if query.get("continue"):
            try:
                token = json.loads(base64.urlsafe_b64decode(query["continue"].encode()))
                token_rv, start_after = int(token["rv"]), tuple(token["start"])
            except (ValueError, KeyError, TypeError):
                raise bad_request("continue key is not valid: the continue token could not be "
                                  "decoded") from None
        with self.cond:
            if token_rv is not None and not self.history_floor <= token_rv <= self.rv:
                raise ApiError(410, "Expired", "The provided continue parameter is too old to "
                               "display a consistent list result. You can start a new list "
                               "without the continue parameter.")
            items = self._matching(resource, ns, lsel, fsel)
            rv = token_rv if token_rv is not None else self.rv
        if start_after is not None:
            items = [o for o in items
                     if (o["metadata"].get("namespace", ""), o["metadata"]["name"]) > start_after]
        meta = {"resourceVersion": str(rv)}
        if limit and len(items) > limit:
            last = items[limit - 1]["metadata"]
            token = {"v": "meta.k8s.io/v1", "rv": rv,
                     "start": [last.get("namespace", ""), last["name"]]}
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(token).encode()).decode()
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        return {"kind": KINDS[resource] + "List", "apiVersion": "v1", "metadata": meta,
                "items": items}

    def delete(self, resource: str, ns: str, name: str, opts: dict, dry_run: bool = False):
        if resource not in ("pods", "secrets"):
            raise method_not_allowed()
        grace = opts.get("gracePeriodSeconds")
        propagation = opts.get("propagationPolicy") or "Background"
        if propagation not in ("Orphan", "Background", "Foreground"):
            raise bad_request(f'DeleteOptions.meta.k8s.io "" is invalid: propagationPolicy: '
                              f'Unsupported value: "{propagation}": supported values: '
                              '"Foreground", "Background", "Orphan", "nil"')
        if opts.get("orphanDependents") is True:
            propagation = "Orphan"
        pre = opts.get("preconditions") or {}
        with self.cond:
            key = (ns, name)
            obj = self.objects[resource].get(key)
            if obj is None:
                raise not_found(resource, name)
            md = obj["metadata"]
            if pre.get("uid") and pre["uid"] != md["uid"]:
                raise conflict(resource, name, f"Precondition failed: UID in precondition: "
                               f"{pre['uid']}, UID in object meta: {md['uid']}")
            if pre.get("resourceVersion") and pre["resourceVersion"] != md["resourceVersion"]:
                raise conflict(resource, name, "Precondition failed: ResourceVersion in "
                               f"precondition: {pre['resourceVersion']}, ResourceVersion in meta: "
                               f"{md['resourceVersion']}")
            if resource == "secrets":
                if not dry_run:
                    self._delete_object(resource, key, orphan=propagation == "Orphan")
                    LOG.info("deleted secret %s/%s", ns, name)
                return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                        "details": {"name": name, "kind": "secrets", "uid": md["uid"]}}
            if dry_run:
                return obj
            return self._delete_pod(key, grace, propagation)

    def delete_collection(self, resource: str, ns: str, query: dict, opts: dict,
                          dry_run: bool = False) -> dict:
        listing = self.list(resource, ns, {k: v for k, v in query.items()
                                           if k in ("labelSelector", "fieldSelector")})
        items = []
        for obj in listing["items"]:
            try:
                res = self.delete(resource, ns, obj["metadata"]["name"], opts, dry_run)
            except ApiError as e:
                if e.code == 404:
                    continue
                raise
            items.append(obj if res.get("kind") == "Status" else res)
        listing["items"] = items
        with self.cond:
            listing["metadata"] = {"resourceVersion": str(self.rv)}
        return listing

    def _delete_pod(self, key: tuple, grace, propagation: str) -> dict:
        pod = self.objects["pods"][key]
        uid = pod["metadata"]["uid"]
        if grace is None:
            grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        grace = max(int(grace), 0)
        rt = self.runtimes.get(uid)
        if rt is None or rt.proc is None or grace == 0 or pod["status"].get("phase") in TERMINAL:
            return self._remove_pod(key, propagation)
        current = pod["metadata"].get("deletionGracePeriodSeconds")
        if current is not None and grace >= current:
            return pod
        deadline = now_rfc3339(grace)

        def mark(o):
            o["metadata"]["deletionTimestamp"] = deadline
            o["metadata"]["deletionGracePeriodSeconds"] = grace

        new = self._modify("pods", key, mark)
        if rt.stop_reason != "delete":
            self._stop(rt, signal.SIGTERM)
        rt.stop_reason = "delete"
        rt.propagation = propagation
        rt.kill_at = time.monotonic() + grace
        LOG.info("deleting pod %s/%s: SIGTERM sent, grace period %ss", key[0], key[1], grace)
        return new

    def _remove_pod(self, key: tuple, propagation: str = "Background") -> dict:
        pod = self.objects["pods"][key]
        uid = pod["metadata"]["uid"]
        rt = self.runtimes.pop(uid, None)
        if rt is not None:
            self._release(rt)
        self.order.pop(uid, None)
        LOG.info("removed pod %s/%s", key[0], key[1])
        return self._delete_object("pods", key, orphan=propagation == "Orphan")

    def patch(self, resource: str, ns: str, name: str, content_type: str, raw: bytes,
              query: dict) -> tuple[int, dict]:
        if resource not in ("pods", "secrets"):
            raise method_not_allowed()
        ctype = (content_type or "").split(";")[0].strip().lower()
        dry_run = query.get("dryRun") == "All"
        if ctype == APPLY_PATCH:
            if not query.get("fieldManager"):
                raise ApiError(422, "Invalid", 'PatchOptions.meta.k8s.io "" is invalid: '
                               'fieldManager: Required value: is required for apply patch',
                               {"group": "meta.k8s.io", "kind": "PatchOptions", "causes": [
                                   {"reason": "FieldValueRequired", "message":
                                    "Required value: is required for apply patch",
                                    "field": "fieldManager"}]})
            try:
                patch = json.loads(raw.decode() or "null")
            except ValueError:
                try:
                    patch = yaml.safe_load(raw.decode())
                except (yaml.YAMLError, UnicodeDecodeError) as e:
                    raise bad_request(f"error decoding YAML: {e}") from None
            if not isinstance(patch, dict):
                raise bad_request("apply patch must be an object")
            with self.cond:
                exists = (ns, name) in self.objects[resource]
            if not exists:
                body = self._check_body(resource, patch, ns, name)
                body["metadata"]["name"] = name
                return 201, self.create(resource, ns, body, dry_run)
            patch = {k: v for k, v in patch.items() if k != "status"}
            apply = lambda cur: merge_patch(cur, patch)  # noqa: E731
        elif ctype in MERGE_PATCH:
            patch = self._json(raw)
            if not isinstance(patch, dict):
                raise bad_request("a merge patch must be a JSON object")
            apply = lambda cur: merge_patch(cur, patch)  # noqa: E731
        elif ctype == JSON_PATCH:
            ops = self._json(raw)
            apply = lambda cur: json_patch(cur, ops)  # noqa: E731
        else:
            raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an "
                           "unknown format - accepted media types include: "
                           "application/json-patch+json, application/merge-patch+json, "
                           "application/apply-patch+yaml", {})
        with self.cond:
            cur = self.objects[resource].get((ns, name))
            if cur is None:
                raise not_found(resource, name)
            return 200, self._update(resource, (ns, name), cur, apply(cur), dry_run)

    def update(self, resource: str, ns: str, name: str, body, dry_run: bool = False) -> dict:
        if resource not in ("pods", "secrets"):
            raise method_not_allowed()
        with self.cond:
            cur = self.objects[resource].get((ns, name))
            if cur is None:
                raise not_found(resource, name)
            return self._update(resource, (ns, name), cur, body, dry_run)

    @staticmethod
    def _json(raw: bytes):
        try:
            return json.loads(raw.decode() or "null")
        except (ValueError, UnicodeDecodeError) as e:
            raise bad_request(f"error decoding patch: {e}") from None

    def _update(self, resource: str, key: tuple, cur: dict, body, dry_run: bool) -> dict:
        ns, name = key
        kind = KINDS[resource]
        new = self._check_body(resource, body, ns, name)
        md = new["metadata"]
        rv = md.get("resourceVersion")
        if rv and rv != cur["metadata"]["resourceVersion"]:
            raise conflict(resource, name, "the object has been modified; please apply your "
                           "changes to the latest version and try again")
        for f in ("name", "namespace", "uid", "creationTimestamp", "generation",
                  "deletionTimestamp", "deletionGracePeriodSeconds", "generateName",
                  "resourceVersion"):
            if f in cur["metadata"]:
                md[f] = cur["metadata"][f]
            else:
                md.pop(f, None)
        if resource == "pods":
            new["status"] = copy.deepcopy(cur.get("status", {}))
        errs = schema_errors(new, self.schema_version)
        if not errs and resource == "secrets":
            self._fold_string_data(new)
            if new.get("type") != cur.get("type"):
                errs.append(invalid_value("type", new.get("type"), "field is immutable"))
            if cur.get("immutable") and (new.get("data") != cur.get("data")
                                         or new.get("immutable") is not True):
                errs.append(FieldError("FieldValueForbidden", "data", None,
                                       "field is immutable when `immutable` is set"))
            errs += validate_secret(new)
        elif not errs:
            default_pod(new)
            before = {k: v for k, v in cur["spec"].items() if k != "activeDeadlineSeconds"}
            after = {k: v for k, v in new["spec"].items() if k != "activeDeadlineSeconds"}
            if before != after:
                errs.append(FieldError("FieldValueForbidden", "spec", None, NOT_CHANGEABLE_MSG))
            errs += validate_pod(new)
        if errs:
            self._reject(kind, name, errs)
        if new == cur or dry_run:
            return cur if new == cur else new
        return self._commit(resource, key, cur, new, "MODIFIED")

    def log_source(self, ns: str, name: str, container: str | None) -> tuple[str, str]:
        """The log file of a pod's container and the pod's uid; 400 while it has not started."""
        with self.cond:
            pod = self.objects["pods"].get((ns, name))
            if pod is None:
                raise not_found("pods", name)
            names = [c["name"] for c in pod["spec"]["containers"]]
            if container and container not in names:
                raise bad_request(f"container {container} is not valid for pod {name}")
            if not container and len(names) > 1:
                raise bad_request(f"a container name must be specified for pod {name}, choose "
                                  f"one of: [{' '.join(names)}]")
            container = container or names[0]
            rt = self.runtimes.get(pod["metadata"]["uid"])
            if container != names[0] or rt is None or not rt.log_started:
                statuses = pod["status"].get("containerStatuses") or [{}]
                reason = ((statuses[0].get("state") or {}).get("waiting") or {}).get(
                    "reason", "ContainerCreating")
                if reason in ("ErrImagePull", "ImagePullBackOff"):
                    reason = "trying and failing to pull image"
                raise bad_request(f'container "{container}" in pod "{name}" is waiting to start: '
                                  f'{reason}')
            return self.log_path(ns, name), pod["metadata"]["uid"]

    def log_live(self, ns: str, name: str, uid: str) -> bool:
        with self.cond:
            pod = self.objects["pods"].get((ns, name))
            rt = self.runtimes.get(uid)
            return not self.stopping and pod is not None and \
                pod["metadata"]["uid"] == uid and rt is not None and rt.proc is not None

    def log_path(self, ns: str, name: str) -> str:
        return os.path.join(self.log_dir, f"{ns}_{name}.log")

    # -- watch -----------------------------------------------------------------------------

    def _expired(self, rv: int) -> dict:
        if rv > self.rv:
            # The real server answers 504 "Too large resource version" after a wait; 410 makes
            # clients (kube-rs's watcher included) re-list, which is what a test wants.
            return ApiError(410, "Expired",
                            f"too large resource version: {rv}, current: {self.rv}").body()
        return ApiError(410, "Expired",
                        f"too old resource version: {rv} ({self.history_floor})").body()

    def watch_start(self, resource: str, ns: str | None, lsel, fsel, rv_param: str,
                    send_initial: bool):
        """(initial objects, resourceVersion to watch from, an ERROR Status or None)."""
        with self.cond:
            if send_initial or rv_param in ("", "0"):
                return self._matching(resource, ns, lsel, fsel), self.rv, None
            start = int(rv_param)
            if start < self.history_floor or start > self.rv:
                return [], start, self._expired(start)
            return [], start, None

    def watch_next(self, last_rv: int, timeout: float):
        """Waits up to `timeout` for history after last_rv: (events, rv, expired, stopping)."""
        with self.cond:
            if self.rv <= last_rv and not self.stopping and timeout > 0:
                self.cond.wait(timeout)
            if self.stopping:
                return [], last_rv, None, True
            if last_rv < self.history_floor:
                return [], last_rv, self._expired(last_rv), False
            events = []
            for ev in reversed(self.history):
                if ev[0] <= last_rv:
                    break
                events.append(ev)
            events.reverse()
            return events, max(last_rv, self.rv), None, False

    # -- test control ----------------------------------------------------------------------

    def add_node(self, raw) -> dict:
        try:
            cfg = node_config(raw)
        except ValueError as e:
            raise bad_request(str(e)) from None
        obj = node_object(cfg, "v" + self.kubernetes_version.lstrip("v"))
        errs = schema_errors(obj, self.schema_version)
        if errs:
            raise RuntimeError(f"node object for {cfg['name']} fails the schema: {errs[0].body()}")
        with self.cond:
            if cfg["name"] in self.node_cfg:
                raise already_exists("nodes", cfg["name"])
            self.node_cfg[cfg["name"]] = cfg
            LOG.info("node %s added: %d GPU(s) %s, cpu %s, memory %s, taints %s", cfg["name"],
                     cfg["gpus"], ",".join(cfg["gpu_uuids"]), cfg["cpu"], cfg["memory"],
                     cfg["taints"])
            return self._commit("nodes", ("", cfg["name"]), None, obj, "ADDED")

    def remove_node(self, name: str) -> dict:
        with self.cond:
            if name not in self.node_cfg:
                raise not_found("nodes", name)
            del self.node_cfg[name]
            for key, pod in sorted(self.objects["pods"].items()):
                if pod["spec"].get("nodeName") != name:
                    continue
                rt = self.runtimes.pop(pod["metadata"]["uid"], None)
                if rt is not None:
                    self._release(rt)
                if pod["status"].get("phase") not in TERMINAL:
                    def lost(o, pod_name=key[1]):
                        st = o["status"]
                        st["phase"] = "Failed"
                        st["reason"] = "NodeLost"
                        st["message"] = (f"Node {name} which was running pod {pod_name} is "
                                         "unresponsive")
                        set_condition(st, "Ready", "False", "PodFailed")
                        set_condition(st, "ContainersReady", "False", "PodFailed")
                    self._modify("pods", key, lost)
                self._remove_pod(key)
            LOG.info("node %s removed", name)
            return self._delete_object("nodes", ("", name))

    def evict(self, ns: str, name: str) -> dict:
        with self.cond:
            key = (ns, name)
            pod = self.objects["pods"].get(key)
            if pod is None:
                raise not_found("pods", name)
            if pod["status"].get("phase") in TERMINAL:
                return pod
            if not pod["spec"].get("nodeName"):
                raise conflict("pods", name, "the pod is not bound to a node, so no kubelet can "
                               "evict it")
            rt = self.runtimes.get(pod["metadata"]["uid"])
            if rt is not None and rt.proc is not None:
                if rt.stop_reason is None:
                    rt.stop_reason = "evict"
                    self._stop(rt, signal.SIGTERM)
                    rt.kill_at = time.monotonic() + EVICTION_GRACE
                    LOG.info("evicting pod %s/%s: SIGTERM sent", ns, name)
                return pod
            if rt is not None:
                rt.stop_reason = "evict"
            return self._fail(key, "Evicted", EVICTED_MESSAGE, None, disruption=True)

    # -- the simulated scheduler and kubelet; the caller holds self.cond ---------------------

    def reconcile(self) -> None:
        now = time.monotonic()
        still_running = []
        for proc in self.orphans:
            if proc.poll() is None:
                still_running.append(proc)
            elif self.watchdog is not None:
                self.watchdog.remove(proc.pid)
        self.orphans = still_running
        self._schedule()
        self._kubelet(now)
        live = {p["metadata"]["uid"] for p in self.objects["pods"].values()}
        for uid in [u for u in self.runtimes if u not in live]:
            self._release(self.runtimes.pop(uid))
        self._sweep_cgroups()

    def _stop(self, rt: PodRuntime, sig: int) -> None:
        """A stop signal for a running container. A namespaced one's goes to its PID 1 (relayed
        by pod_runtime.py's shim), as containerd's shim signals the container's init only; a
        plain process's to its whole process group. SIGKILL always goes to the group: the
        container's init dies with it (or with its parent), and the kernel then kills every
        process in its PID namespace."""
        if rt.namespaced and sig != signal.SIGKILL:
            try:
                os.kill(rt.proc.pid, sig)
            except ProcessLookupError:
                pass
        else:
            _kill_group(rt.proc.pid, sig)

    def _container_gone(self, rt: PodRuntime) -> None:
        """The container's process has exited or been given up: its report pipe is closed and
        its cgroups are removed as soon as they are empty (_sweep_cgroups)."""
        if rt.status_fd is not None:
            os.close(rt.status_fd)
            rt.status_fd = None
        rt.starting = False
        self.cgroup_trash.update(rt.cgroups)
        rt.cgroups = []

    def _release(self, rt: PodRuntime) -> None:
        """A pod's runtime dropped (pod removed, node lost): its process group SIGKILLed and
        reaped later, everything it held given back."""
        if rt.proc is not None:
            _kill_group(rt.proc.pid, signal.SIGKILL)
            self.orphans.append(rt.proc)
            rt.proc = None
        self._container_gone(rt)
        if rt.userns_slot is not None:
            self.userns_used.discard(rt.userns_slot)
            rt.userns_slot = None

    def _sweep_cgroups(self) -> None:
        for d in sorted(self.cgroup_trash):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                continue   # EBUSY: its processes are still being killed
            self.cgroup_trash.discard(d)

    def _node_usage(self, node: str) -> tuple[dict, set, int]:
        used: dict = collections.defaultdict(fractions.Fraction)
        gpus, count = set(), 0
        for pod in self.objects["pods"].values():
            if pod["spec"].get("nodeName") != node or pod["status"].get("phase") in TERMINAL:
                continue
            count += 1
            for res, q in pod_requests(pod).items():
                used[res] += q
            assigned = (pod["metadata"].get("annotations") or {}).get(GPU_ANNOTATION, "")
            gpus.update(u for u in assigned.split(",") if u)
        return used, gpus, count

    def _fit_failure(self, pod: dict, node: dict, cfg: dict, usage) -> str | None:
        spec = pod["spec"]
        for taint in node["spec"].get("taints") or []:
            if taint.get("effect") in ("NoSchedule", "NoExecute") and \
                    not any(tolerates(t, taint) for t in spec.get("tolerations") or []):
                return f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
        labels = node["metadata"].get("labels") or {}
        mismatch = "node(s) didn't match Pod's node affinity/selector"
        if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
            return mismatch
        required_terms = ((((spec.get("affinity") or {}).get("nodeAffinity") or {})
                           .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
                          .get("nodeSelectorTerms"))
        if required_terms is not None and \
                not any(node_selector_term_matches(t, node) for t in required_terms):
            return mismatch
        if spec.get("runtimeClassName") and spec["runtimeClassName"] not in cfg["runtime_classes"]:
            return mismatch
        used, _, count = usage
        if count + 1 > MAX_PODS_PER_NODE:
            return "Too many pods"
        requests = pod_requests(pod)
        allocatable = node["status"]["allocatable"]
        order = ["cpu", "memory", "ephemeral-storage"] + sorted(
            r for r in requests if r not in ("cpu", "memory", "ephemeral-storage"))
        for res in order:
            want = requests.get(res, 0)
            if not want:
                continue
            have = parse_quantity(allocatable[res]) if res in allocatable else 0
            if used.get(res, 0) + want > have:
                return f"Insufficient {res}"
        return None

    def _schedule(self) -> None:
        pending = [(key, p) for key, p in self.objects["pods"].items()
                   if not p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
                   and p["status"].get("phase") == "Pending"
                   and p["spec"].get("schedulerName", "default-scheduler") == "default-scheduler"]
        pending.sort(key=lambda kp: self.order.get(kp[1]["metadata"]["uid"], 0))
        for key, pod in pending:
            reasons: collections.Counter = collections.Counter()
            fits = []
            for name in sorted(self.node_cfg):
                cfg = self.node_cfg[name]
                node = self.objects["nodes"][("", name)]
                usage = self._node_usage(name)
                why = self._fit_failure(pod, node, cfg, usage)
                if why:
                    reasons[why] += 1
                else:
                    fits.append((cfg["gpus"] - len(usage[1]), name, usage[1]))
            if fits:
                _, name, taken = min(fits)
                want = pod_gpus(pod)
                free = [u for u in self.node_cfg[name]["gpu_uuids"] if u not in taken]

                def bind(o, name=name, gpus=free[:want]):
                    o["spec"]["nodeName"] = name
                    if gpus:
                        o["metadata"].setdefault("annotations", {})[GPU_ANNOTATION] = ",".join(gpus)
                    set_condition(o["status"], "PodScheduled", "True")

                self._modify("pods", key, bind)
                LOG.info("scheduler: bound pod %s/%s to %s%s", key[0], key[1], name,
                         f" with GPUs {','.join(free[:want])}" if want else "")
                continue
            message = self._unschedulable_message(reasons)

            def unschedulable(o, message=message):
                set_condition(o["status"], "PodScheduled", "False", "Unschedulable", message)

            before = pod
            after = self._modify("pods", key, unschedulable)
            if after is not before:
                LOG.info("scheduler: pod %s/%s unschedulable: %s", key[0], key[1], message)

    def _unschedulable_message(self, reasons: collections.Counter) -> str:
        total = sum(reasons.values())
        if total == 0:
            return "no nodes available to schedule pods"
        preemption: collections.Counter = collections.Counter()
        for reason, n in reasons.items():
            if reason.startswith("Insufficient") or reason == "Too many pods":
                preemption["No preemption victims found for incoming pod"] += n
            else:
                preemption["Preemption is not helpful for scheduling"] += n
        filters = ", ".join(sorted(f"{n} {r}" for r, n in reasons.items()))
        victims = ", ".join(sorted(f"{n} {r}" for r, n in preemption.items()))
        return (f"0/{total} nodes are available: {filters}. "
                f"preemption: 0/{total} nodes are available: {victims}.")

    def _container_status(self, pod: dict, rt: PodRuntime, state: dict, ready: bool,
                          started: bool) -> dict:
        c = pod["spec"]["containers"][0]
        image = c.get("image", "")
        running = "running" in state or "terminated" in state
        cs = {"name": c["name"], "state": state, "lastState": copy.deepcopy(rt.last_state),
              "ready": ready, "restartCount": rt.restarts, "image": image,
              "imageID": (f"{image}@sha256:{hashlib_sha256(image)}" if running else "")}
        if running and rt.container_id:
            cs["containerID"] = rt.container_id
        cs["started"] = started
        return cs

    def _set_waiting(self, key: tuple, rt: PodRuntime, reason: str, message: str | None) -> None:
        def waiting(o):
            state = {"waiting": {"reason": reason}}
            if message:
                state["waiting"]["message"] = message
            o["status"]["containerStatuses"] = [self._container_status(o, rt, state, False, False)]
            name = o["spec"]["containers"][0]["name"]
            set_condition(o["status"], "Ready", "False", "ContainersNotReady",
                          f"containers with unready status: [{name}]")
            set_condition(o["status"], "ContainersReady", "False", "ContainersNotReady",
                          f"containers with unready status: [{name}]")

        before = self.objects["pods"].get(key)
        if self._modify("pods", key, waiting) is not before:
            LOG.info("kubelet: pod %s/%s container waiting: %s%s", key[0], key[1], reason,
                     f" ({message})" if message else "")

    def _finish(self, key: tuple, phase: str, term: dict | None, reason: str | None = None,
                message: str | None = None, disruption: bool = False) -> dict:
        rt = self.runtimes.get(self.objects["pods"][key]["metadata"]["uid"]) or PodRuntime("", 0)

        def done(o):
            st = o["status"]
            st["phase"] = phase
            if reason:
                st["reason"] = reason
            if message:
                st["message"] = message
            if term is not None:
                st["containerStatuses"] = [self._container_status(o, rt, {"terminated": term},
                                                                  False, False)]
            set_condition(st, "Ready", "False", "PodCompleted")
            set_condition(st, "ContainersReady", "False", "PodCompleted")
            if disruption:
                set_condition(st, "DisruptionTarget", "True", "TerminationByKubelet", message)

        LOG.info("kubelet: pod %s/%s %s%s", key[0], key[1], phase,
                 f" ({reason}: {message})" if reason else "")
        return self._modify("pods", key, done)

    def _fail(self, key: tuple, reason: str, message: str, term: dict | None,
              disruption: bool = False) -> dict:
        return self._finish(key, "Failed", term, reason, message, disruption)

    def _kubelet(self, now: float) -> None:
        pods = sorted(self.objects["pods"].items(),
                      key=lambda kp: self.order.get(kp[1]["metadata"]["uid"], 0))
        for key, pod in pods:
            if key not in self.objects["pods"]:
                continue
            pod = self.objects["pods"][key]
            node = pod["spec"].get("nodeName")
            if not node or node not in self.node_cfg:
                continue
            rt = self.runtimes.get(pod["metadata"]["uid"])
            if rt is None:
                if pod["status"].get("phase") in TERMINAL:
                    continue
                if pod["metadata"].get("deletionTimestamp"):
                    self._remove_pod(key)
                    continue
                self._admit(key, pod, now)
                continue
            try:
                self._kubelet_step(key, pod, rt, now)
            except Exception:  # keep the loop alive; a bug here must not stop other pods
                LOG.exception("kubelet: pod %s/%s", key[0], key[1])

    def _admit(self, key: tuple, pod: dict, now: float) -> None:
        uid = pod["metadata"]["uid"]
        rt = PodRuntime(uid, now)
        self.runtimes[uid] = rt
        node = pod["spec"]["nodeName"]
        want = pod_gpus(pod)
        assigned = (pod["metadata"].get("annotations") or {}).get(GPU_ANNOTATION)
        gpus = None
        if want and not assigned:   # bound by the client (spec.nodeName), not by the scheduler
            _, taken, _ = self._node_usage(node)
            free = [u for u in self.node_cfg[node]["gpu_uuids"] if u not in taken]
            if len(free) < want:
                self._fail(key, "UnexpectedAdmissionError",
                           f"Allocate failed due to requested number of devices unavailable for "
                           f"{GPU}. Requested: {want}, Available: {len(free)}, which is unexpected",
                           None)
                return
            gpus = free[:want]

        def admitted(o):
            if gpus:
                o["metadata"].setdefault("annotations", {})[GPU_ANNOTATION] = ",".join(gpus)
            st = o["status"]
            st["hostIP"] = "127.0.0.1"
            st["hostIPs"] = [{"ip": "127.0.0.1"}]
            st["startTime"] = now_rfc3339()
            set_condition(st, "Initialized", "True")
            set_condition(st, "PodScheduled", "True")
            name = o["spec"]["containers"][0]["name"]
            set_condition(st, "Ready", "False", "ContainersNotReady",
                          f"containers with unready status: [{name}]")
            set_condition(st, "ContainersReady", "False", "ContainersNotReady",
                          f"containers with unready status: [{name}]")
            st["containerStatuses"] = [self._container_status(
                o, rt, {"waiting": {"reason": "ContainerCreating"}}, False, False)]

        self._modify("pods", key, admitted)
        LOG.info("kubelet: admitted pod %s/%s on %s", key[0], key[1], node)

    def _kubelet_step(self, key: tuple, pod: dict, rt: PodRuntime, now: float) -> None:
        spec = pod["spec"]
        deadline = spec.get("activeDeadlineSeconds")
        past_deadline = deadline is not None and now - rt.admitted >= deadline
        if rt.proc is not None:
            if rt.starting:
                self._read_start_report(key, rt)
            code = _reap(rt.proc)
            if code is not None:
                if self.watchdog is not None:
                    self.watchdog.remove(rt.proc.pid)
                rt.proc = None
                error = self._read_start_report(key, rt) if rt.starting else None
                self._container_gone(rt)
                if error is not None:
                    self._start_failed(key, rt, error)
                else:
                    self._container_exited(key, rt, code)
            elif rt.kill_at is not None and now >= rt.kill_at:
                LOG.info("kubelet: pod %s/%s did not stop in time, SIGKILL", key[0], key[1])
                _kill_group(rt.proc.pid, signal.SIGKILL)
                rt.kill_at = None
            elif past_deadline and rt.stop_reason is None:
                LOG.info("kubelet: pod %s/%s passed activeDeadlineSeconds", key[0], key[1])
                rt.stop_reason = "deadline"
                self._stop(rt, signal.SIGTERM)
                rt.kill_at = now + DEADLINE_GRACE
            return
        if pod["status"].get("phase") in TERMINAL:
            return
        if pod["metadata"].get("deletionTimestamp"):
            self._remove_pod(key, rt.propagation)
            return
        if rt.stop_reason == "evict":
            self._fail(key, "Evicted", EVICTED_MESSAGE, None, disruption=True)
            return
        if past_deadline:
            self._fail(key, "DeadlineExceeded", DEADLINE_MESSAGE, None)
            return
        if now < rt.next_try or self.stopping:
            return
        container = spec["containers"][0]
        image = container.get("image", "")
        if "does-not-exist" in image:
            if rt.pull_failed_at is None:
                rt.pull_failed_at = now
                self._set_waiting(key, rt, "ErrImagePull",
                                  f'failed to pull and unpack image "{image}": failed to resolve '
                                  f'reference "{image}": {image}: not found')
            elif now - rt.pull_failed_at >= IMAGE_BACKOFF_AFTER:
                self._set_waiting(key, rt, "ImagePullBackOff", f'Back-off pulling image "{image}"')
            return
        self._start_container(key, pod, rt, now)

    def _container_env(self, pod: dict, container: dict, home: str, gpus: list[str] | None,
                       gpu_node: bool) -> dict:
        md = pod["metadata"]
        ns = md["namespace"]
        env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": home,
               "HOSTNAME": md["name"], "KUBERNETES_SERVICE_HOST": "127.0.0.1",
               "KUBERNETES_SERVICE_PORT": str(self.port)}

        def secret(name: str, optional: bool):
            s = self.objects["secrets"].get((ns, name))
            if s is None and not optional:
                raise ConfigError(f'secret "{name}" not found')
            return s

        def decode(value: str) -> str:
            return base64.b64decode(value.replace("\r", "").replace("\n", "")).decode(
                "utf-8", "surrogateescape")

        for source in container.get("envFrom") or []:
            prefix = source.get("prefix") or ""
            ref = source.get("secretRef")
            if ref is not None:
                s = secret(ref.get("name", ""), bool(ref.get("optional")))
                for k, v in sorted(((s or {}).get("data") or {}).items()):
                    env[prefix + k] = decode(v)
            ref = source.get("configMapRef")
            if ref is not None and not ref.get("optional"):
                raise ConfigError(f'configmap "{ref.get("name", "")}" not found')
        for entry in container.get("env") or []:
            name, vf = entry["name"], entry.get("valueFrom")
            if vf is None:
                env[name] = expand_vars(entry.get("value") or "", env)
                continue
            if vf.get("secretKeyRef") is not None:
                ref = vf["secretKeyRef"]
                optional = bool(ref.get("optional"))
                s = secret(ref["name"], optional)
                if s is None:
                    continue
                data = s.get("data") or {}
                if ref["key"] not in data:
                    if optional:
                        continue
                    raise ConfigError(f"couldn't find key {ref['key']} in Secret "
                                      f"{ns}/{ref['name']}")
                env[name] = decode(data[ref["key"]])
            elif vf.get("configMapKeyRef") is not None:
                ref = vf["configMapKeyRef"]
                if not ref.get("optional"):
                    raise ConfigError(f'configmap "{ref.get("name", "")}" not found')
            elif vf.get("fieldRef") is not None:
                env[name] = self._field_ref(pod, vf["fieldRef"].get("fieldPath", ""))
            elif vf.get("resourceFieldRef") is not None:
                env[name] = self._resource_ref(pod, container, vf["resourceFieldRef"])
        if gpus:
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(gpus)
        elif gpu_node:
            env["NVIDIA_VISIBLE_DEVICES"] = "void"
        return env

    @staticmethod
    def _device_plugin(env: dict, home: str, cfg: dict, gpus: list[str] | None) -> None:
        """Hands the container its GPUs as the node's device plugin would (`device_plugin`).
        A GPU's index and minor number are its position in the node's `gpu_uuids`."""
        root = os.path.join(home, "root")
        dev = os.path.join(root, "dev")
        os.makedirs(dev, exist_ok=True)
        env["GPUCI_GRANT_ROOT"] = root
        if not gpus:
            return
        plugin = cfg["device_plugin"]
        index = {u: i for i, u in enumerate(cfg["gpu_uuids"])}
        ids = [str(index[u]) for u in gpus] if plugin.endswith("-index") else list(gpus)
        # Every mechanism ends with the GPUs' nodes and the driver's shared nodes injected
        # (the NVIDIA runtime, the CDI spec's deviceNodes, GKE's device specs).
        for name in [f"nvidia{index[u]}" for u in gpus] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]:
            open(os.path.join(dev, name), "w").close()
        if plugin.startswith("envvar"):
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(ids)
        elif plugin.startswith("volume-mounts"):
            # server.go updateResponseForDeviceMounts: the variable names the directory, and
            # each id is a bind of /dev/null there.
            env["NVIDIA_VISIBLE_DEVICES"] = VOLUME_MOUNTS_DIR
            listing = os.path.join(root, VOLUME_MOUNTS_DIR.lstrip("/"))
            os.makedirs(listing, exist_ok=True)
            for i in ids:
                open(os.path.join(listing, i), "w").close()
        elif plugin == "cdi":
            # Only CDI strategies: the plugin sets no variable; nvidia-ctk's spec sets void.
            env["NVIDIA_VISIBLE_DEVICES"] = "void"
        else:  # gke: device specs only, no variable at all
            env.pop("NVIDIA_VISIBLE_DEVICES", None)

    @staticmethod
    def _field_ref(pod: dict, path: str) -> str:
        md = pod["metadata"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']*)'\]", path)
        if m:
            return (md.get(m.group(1)) or {}).get(m.group(2), "")
        if path in ("metadata.labels", "metadata.annotations"):
            values = md.get(path.split(".")[1]) or {}
            return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
        simple = {"metadata.name": md["name"], "metadata.namespace": md["namespace"],
                  "metadata.uid": md["uid"], "spec.nodeName": pod["spec"].get("nodeName", ""),
                  "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
                  "status.podIP": "127.0.0.1", "status.podIPs": "127.0.0.1",
                  "status.hostIP": "127.0.0.1", "status.hostIPs": "127.0.0.1"}
        return simple.get(path, "")

    def _resource_ref(self, pod: dict, container: dict, ref: dict) -> str:
        kind, _, res = (ref.get("resource") or "").partition(".")
        target = container
        if ref.get("containerName"):
            target = next((c for c in pod["spec"]["containers"]
                           if c["name"] == ref["containerName"]), container)
        value = ((target.get("resources") or {}).get(kind) or {}).get(res)
        if value is None and kind == "limits":
            node = self.objects["nodes"].get(("", pod["spec"].get("nodeName", "")))
            value = node["status"]["allocatable"].get(res) if node else None
        if value is None:
            return "0"
        try:
            q = parse_quantity(value) / parse_quantity(ref.get("divisor") or "1")
        except (ValueError, ZeroDivisionError):
            return "0"
        return str(-(-q.numerator // q.denominator))

    def _start_container(self, key: tuple, pod: dict, rt: PodRuntime, now: float) -> None:
        ns, name = key
        uid = pod["metadata"]["uid"]
        container = pod["spec"]["containers"][0]
        cfg = self.node_cfg[pod["spec"]["nodeName"]]
        assigned = (pod["metadata"].get("annotations") or {}).get(GPU_ANNOTATION, "")
        want = container_gpus(container)
        gpus = [u for u in assigned.split(",") if u][:want] if want else None
        home = os.path.join(self.log_dir, "pods", f"{ns}_{name}_{uid}")
        os.makedirs(home, exist_ok=True)
        try:
            env = self._container_env(pod, container, home, gpus, cfg["gpus"] > 0)
        except ConfigError as e:
            rt.next_try = now + KUBELET_RETRY
            self._set_waiting(key, rt, "CreateContainerConfigError", str(e))
            return
        self._device_plugin(env, home, cfg, gpus)
        argv = [expand_vars(str(a), env)
                for a in (container.get("command") or []) + (container.get("args") or [])]
        if not argv:
            argv = ["sleep", "infinity"]   # stands in for an image's default long-running process
        log_path = self.log_path(ns, name)
        rt.container_id = "containerd://" + hashlib_sha256(f"{uid}/{rt.restarts}")
        rt.started_at = now_rfc3339()
        sec = container_security(pod, container)
        rt.namespaced = not sec["privileged"] and self.namespaces
        rt.status, rt.status_fd, rt.starting = b"", None, False
        status_w = None
        try:
            rt.cgroups = self._pod_cgroup(key, uid, container)
            if rt.namespaced:
                spec = self._runtime_spec(pod, rt, sec, home)
                status_r, status_w = os.pipe()
                os.set_blocking(status_r, False)
                rt.status_fd, rt.starting = status_r, True
                cmd = [sys.executable, "-I", "-S", POD_RUNTIME, json.dumps(spec), str(status_w),
                       "--", *argv]
                setup = _child_setup
            else:
                # A real privileged container gets every capability and every host device,
                # and no masked paths: as close to this plain process as a container comes.
                # It still has its cgroup.
                cmd, setup = argv, functools.partial(_child_setup, rt.cgroups)
            with open(log_path, "ab" if rt.log_started else "wb") as log_file:
                rt.log_started = True
                proc = subprocess.Popen(cmd, cwd=home, env=env, stdin=subprocess.DEVNULL,
                                        stdout=log_file, stderr=subprocess.STDOUT,
                                        start_new_session=True, close_fds=True,
                                        pass_fds=(status_w,) if status_w is not None else (),
                                        preexec_fn=setup)
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            if status_w is not None:
                os.close(status_w)
            self._container_gone(rt)
            self._start_failed(key, rt, f'exec: "{argv[0]}": {e}')
            return
        if status_w is not None:
            os.close(status_w)
        rt.proc = proc
        if self.watchdog is not None:
            self.watchdog.add(proc.pid)
        how = (("a plain process (privileged)" if sec["privileged"] else
                "a plain process (the server is not root)") if not rt.namespaced else
               f"{sec['userns'] and 'user, ' or ''}mount, pid, uts and ipc namespaces"
               f"{'' if sec['masked'] else ', unmasked /proc'}")
        LOG.info("kubelet: pod %s/%s started as pid %d in %s%s: %s", ns, name, proc.pid, how,
                 f", cgroup {rt.cgroups[0]}" if rt.cgroups else "", argv)
        if not rt.namespaced:
            self._mark_running(key, rt)

    def _runtime_spec(self, pod: dict, rt: PodRuntime, sec: dict, home: str) -> dict:
        """What pod_runtime.py is to do, as the kubelet hands CRI a container config."""
        userns = None
        if sec["userns"]:
            if rt.userns_slot is None:
                free = next((k for k in range(USERNS_SLOTS) if k not in self.userns_used), None)
                if free is None:
                    raise OSError("no user namespace range is free")
                self.userns_used.add(free)
                rt.userns_slot = free
            base = USERNS_FIRST + USERNS_SIZE * rt.userns_slot
            userns = {"base": base, "size": USERNS_SIZE}
            _chown_tree(home, base)
        # The kubelet's truncatePodHostnameIfNeeded: 63 characters, no trailing '-' or '.'.
        hostname = pod["metadata"]["name"][:63].rstrip("-.")
        return {"home": home, "hostname": hostname, "userns": userns,
                "masked_paths": list(MASKED_PATHS) if sec["masked"] else [],
                "readonly_paths": list(READONLY_PATHS) if sec["masked"] else [],
                "capabilities": sec["capabilities"], "cgroups": rt.cgroups}

    def _pod_cgroup(self, key: tuple, uid: str, container: dict) -> list[str]:
        if self.pod_cgroups is None or not self.pod_cgroups.bases:
            return []
        limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
        bytes_ = None
        if limit is not None:
            q = parse_quantity(limit)
            bytes_ = -(-q.numerator // q.denominator)
        try:
            dirs = self.pod_cgroups.create(uid, bytes_)
        except OSError as e:
            LOG.warning("kubelet: pod %s/%s runs in the server's cgroup: %s", key[0], key[1], e)
            return []
        self.cgroup_trash.difference_update(dirs)
        if self.watchdog is not None:
            for d in dirs:
                self.watchdog.cgroup(d)
        return dirs

    def _read_start_report(self, key: tuple, rt: PodRuntime) -> str | None:
        """Reads pod_runtime.py's one line: `ok` marks the container Running; `error: why` is
        returned (the process exits with 128 just after)."""
        while rt.status_fd is not None:
            try:
                chunk = os.read(rt.status_fd, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            rt.status += chunk
        line, nl, _ = rt.status.partition(b"\n")
        if not nl:
            return None
        text = line.decode(errors="replace")
        if text == "ok":
            if rt.starting:
                rt.starting = False
                self._mark_running(key, rt)
            return None
        return text.removeprefix("error: ")

    def _start_failed(self, key: tuple, rt: PodRuntime, error: str) -> None:
        message = (f"failed to create containerd task: failed to create shim task: OCI runtime "
                   f"create failed: runc create failed: unable to start container process: "
                   f"{error}")
        with open(self.log_path(*key), "ab") as log_file:
            log_file.write((message + "\n").encode())
        LOG.info("kubelet: pod %s/%s failed to start: %s", key[0], key[1], error)
        self._container_exited(key, rt, 128, "StartError", message)

    def _mark_running(self, key: tuple, rt: PodRuntime) -> None:
        def running(o):
            st = o["status"]
            st["phase"] = "Running"
            st["podIP"] = "127.0.0.1"
            st["podIPs"] = [{"ip": "127.0.0.1"}]
            st["containerStatuses"] = [self._container_status(
                o, rt, {"running": {"startedAt": rt.started_at}}, True, True)]
            set_condition(st, "Initialized", "True")
            set_condition(st, "Ready", "True")
            set_condition(st, "ContainersReady", "True")

        self._modify("pods", key, running)

    def _container_exited(self, key: tuple, rt: PodRuntime, code: int, reason: str | None = None,
                          message: str | None = None) -> None:
        pod = self.objects["pods"][key]
        term = {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error")}
        container = pod["spec"]["containers"][0]
        if not message and code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            # The kubelet's fallback (pkg/kubelet/kuberuntime: the last 80 lines of the log, at
            # most 2048 bytes) when the container wrote no termination message file.
            try:
                with open(self.log_path(*key), "rb") as f:
                    tail = b"\n".join(f.read().splitlines()[-80:])[-2048:]
                message = tail.decode("utf-8", "replace").strip() or None
            except OSError:
                pass
        if message:
            term["message"] = message
        term.update({"startedAt": rt.started_at or now_rfc3339(), "finishedAt": now_rfc3339()})
        if rt.container_id:
            term["containerID"] = rt.container_id
        LOG.info("kubelet: pod %s/%s container exited with code %d", key[0], key[1], code)
        rt.kill_at = None
        if rt.stop_reason == "delete":
            self._finish(key, "Succeeded" if code == 0 else "Failed", term)
            self._remove_pod(key, rt.propagation)
        elif rt.stop_reason == "evict":
            self._fail(key, "Evicted", EVICTED_MESSAGE, term, disruption=True)
        elif rt.stop_reason == "deadline":
            self._fail(key, "DeadlineExceeded", DEADLINE_MESSAGE, term)
        else:
            policy = pod["spec"].get("restartPolicy", "Always")
            if policy == "Always" or (policy == "OnFailure" and code != 0):
                rt.restarts += 1
                rt.last_state = {"terminated": term}
                backoff = min(0.25 * 2 ** (rt.restarts - 1), 5.0)
                rt.next_try = time.monotonic() + backoff
                cname = pod["spec"]["containers"][0]["name"]
                self._set_waiting(key, rt, "CrashLoopBackOff",
                                  f"back-off {backoff:g}s restarting failed container={cname} "
                                  f"pod={key[1]}_{key[0]}({pod['metadata']['uid']})")
            else:
                self._finish(key, "Succeeded" if code == 0 else "Failed", term)

    def kill_everything(self) -> None:
        """SIGKILLs every pod process group the server started and reaps them."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
            procs = [rt.proc for rt in self.runtimes.values() if rt.proc is not None]
            procs += self.orphans
            for proc in procs:
                _kill_group(proc.pid, signal.SIGKILL)
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                LOG.error("pod process %d did not die after SIGKILL", proc.pid)
        if procs:
            LOG.info("killed %d pod process group(s)", len(procs))
        with self.cond:
            for rt in self.runtimes.values():
                rt.proc = None
                self._container_gone(rt)
            # A PID namespace's last processes are reaped by the kernel just after its init.
            end = time.monotonic() + 3
            while self.cgroup_trash and time.monotonic() < end:
                self._sweep_cgroups()
                if self.cgroup_trash:
                    time.sleep(0.05)
            if self.cgroup_trash:
                LOG.error("pod cgroups left behind (not empty): %s", sorted(self.cgroup_trash))
            if self.pod_cgroups is not None:
                self.pod_cgroups.remove_bases()
        if self.watchdog is not None:
            self.watchdog.close()


def hashlib_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# RBAC (one Role from --rbac)


def load_rbac(path: str) -> list[dict]:
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    roles = [d for d in docs if isinstance(d, dict) and d.get("kind") in ("Role", "ClusterRole")]
    if len(roles) != 1:
        raise SystemExit(f"--rbac {path}: expected exactly one `kind: Role`, found {len(roles)}")
    rules = roles[0].get("rules") or []
    for i, rule in enumerate(rules):
        for field in ("apiGroups", "resources", "verbs"):
            if not isinstance(rule.get(field), list):
                raise SystemExit(f"--rbac {path}: rules[{i}].{field} must be a list")
    return rules


def rbac_allows(rules: list[dict], verb: str, resource: str, sub: str | None,
                name: str | None) -> bool:
    target = resource + ("/" + sub if sub else "")
    for rule in rules:
        groups = rule.get("apiGroups") or []
        if "" not in groups and "*" not in groups:
            continue
        resources = rule.get("resources") or []
        if "*" not in resources and target not in resources and \
                not (sub and f"*/{sub}" in resources):
            continue
        verbs = rule.get("verbs") or []
        if "*" not in verbs and verb not in verbs:
            continue
        names = rule.get("resourceNames") or []
        if names and (not name or name not in names):
            continue
        return True
    return False


# ---------------------------------------------------------------------------------------------
# HTTP


def version_info(version: str) -> dict:
    m = re.match(r"v?(\d+)\.(\d+)", version)
    return {"major": m.group(1), "minor": m.group(2), "gitVersion": "v" + version.lstrip("v"),
            "gitCommit": "0" * 40, "gitTreeState": "clean", "buildDate": "2024-01-01T00:00:00Z",
            "goVersion": "go1.22.0", "compiler": "gc", "platform": "linux/amd64"}


API_RESOURCES = {
    "kind": "APIResourceList", "groupVersion": "v1", "resources": [
        {"name": "namespaces", "singularName": "namespace", "namespaced": False,
         "kind": "Namespace", "verbs": RESOURCE_VERBS["namespaces"], "shortNames": ["ns"]},
        {"name": "nodes", "singularName": "node", "namespaced": False, "kind": "Node",
         "verbs": RESOURCE_VERBS["nodes"], "shortNames": ["no"]},
        {"name": "pods", "singularName": "pod", "namespaced": True, "kind": "Pod",
         "verbs": RESOURCE_VERBS["pods"], "shortNames": ["po"], "categories": ["all"]},
        {"name": "pods/log", "singularName": "", "namespaced": True, "kind": "Pod",
         "verbs": ["get"]},
        {"name": "secrets", "singularName": "secret", "namespaced": True, "kind": "Secret",
         "verbs": RESOURCE_VERBS["secrets"]},
    ]}

METHOD_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


def parse_api_path(parts: list[str], method: str, query: dict) -> dict:
    """The API server's RequestInfo for /api and /apis paths (parts exclude the leading '')."""
    info = {"kind": "notfound", "verb": method.lower() if method != "GET" else "get",
            "resource": None, "subresource": None, "namespace": None, "name": None}
    if parts == ["api"]:
        info["kind"] = "api"
        return info
    if parts == ["apis"]:
        info["kind"] = "apis"
        return info
    if parts[:2] != ["api", "v1"]:
        return info
    rest = parts[2:]
    watch = truthy(query.get("watch"))
    if rest and rest[0] == "watch":
        watch, rest = True, rest[1:]
    if not rest:
        info["kind"] = "discovery"
        return info
    if rest[0] == "namespaces":
        if len(rest) == 1:
            info["resource"] = "namespaces"
        elif len(rest) == 2:
            info.update(resource="namespaces", name=rest[1], namespace=rest[1])
        elif len(rest) <= 5:
            info.update(namespace=rest[1], resource=rest[2],
                        name=rest[3] if len(rest) > 3 else None,
                        subresource=rest[4] if len(rest) > 4 else None)
        else:
            return info
    else:
        if len(rest) > 3:
            return info
        info.update(resource=rest[0], name=rest[1] if len(rest) > 1 else None,
                    subresource=rest[2] if len(rest) > 2 else None)
    if method == "GET":
        info["verb"] = "watch" if watch else ("get" if info["name"] else "list")
    elif method == "DELETE":
        info["verb"] = "delete" if info["name"] else "deletecollection"
    else:
        info["verb"] = METHOD_VERBS.get(method, method.lower())
    info["kind"] = "resource"
    return info


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address, cluster: Cluster, token: str):
        super().__init__(address, Handler)
        self.cluster = cluster
        self.token = token
        self._conn_lock = threading.Lock()
        self._conns: set = set()

    def track(self, conn, add: bool) -> None:
        with self._conn_lock:
            (self._conns.add if add else self._conns.discard)(conn)

    def close_connections(self) -> None:
        with self._conn_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return
        LOG.exception("error serving %s", client_address)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "gpuci-kube-testserver"
    sys_version = ""

    def version_string(self) -> str:
        return self.server_version
    server: Server

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes; without TCP_NODELAY every keep-alive
        # request would wait ~40 ms for a delayed ACK (Nagle).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        LOG.debug("%s " + format, self.address_string(), *args)

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")

    def do_PATCH(self):
        self._handle("PATCH")

    def do_DELETE(self):
        self._handle("DELETE")

    def do_HEAD(self):
        self._handle("HEAD")

    def do_OPTIONS(self):
        self._handle("OPTIONS")

    # -- plumbing ----------------------------------------------------------------------------

    def _handle(self, method: str) -> None:
        self._record: dict | None = None
        self._sent = False
        try:
            body = self._read_body()
        except (ValueError, OSError) as e:
            self.close_connection = True
            self._send_json(400, bad_request(f"could not read the request body: {e}").body())
            return
        url = urllib.parse.urlsplit(self.path)
        query = {k: v[-1] for k, v in
                 urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
        path = url.path.rstrip("/") or "/"
        try:
            self._route(method, path, query, body)
        except ApiError as e:
            if self._sent:
                self.close_connection = True
            else:
                self._send_json(e.code, e.body())
        except (ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception as e:
            LOG.exception("internal error serving %s %s", method, self.path)
            if self._sent:
                self.close_connection = True
            else:
                self._send_json(500, ApiError(500, "InternalError",
                                              f"Internal error occurred: {e}").body())

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            data = b""
            while True:
                line = self.rfile.readline(65537)
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    return data
                data += self.rfile.read(size)
                self.rfile.readline(65537)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _note(self, code: int) -> None:
        self._sent = True
        if self._record is not None and not self._inspecting():
            self._record["code"] = code
            self.server.cluster.record_request(dict(self._record))
        LOG.info("%s %s -> %d", self.command, self.path, code)

    def _send_bytes(self, code: int, content_type: str, data: bytes) -> None:
        self._note(code)
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache, private")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_json(self, code: int, obj) -> None:
        self._send_bytes(code, "application/json",
                         (json.dumps(obj, separators=(",", ":")) + "\n").encode())

    def _start_chunked(self, code: int, content_type: str) -> None:
        self._note(code)
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(b"%x\r\n" % len(data) + data + b"\r\n")

    def _end_chunked(self) -> None:
        self.wfile.write(b"0\r\n\r\n")

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _inspecting(self) -> bool:
        """A test looking at the cluster (header `X-Test-Inspect: 1`): not bound by --rbac
        and not recorded in /_test/requests, so what the client under test did stays apart."""
        return self.headers.get("X-Test-Inspect") == "1"

    def _authorized(self) -> bool | None:
        """None without an Authorization header, else whether it carries the bearer token."""
        header = self.headers.get("Authorization")
        if header is None:
            return None
        return hmac.compare_digest(header.encode(), f"Bearer {self.server.token}".encode())

    @staticmethod
    def _json_body(body: bytes):
        try:
            return json.loads(body.decode() or "null")
        except (ValueError, UnicodeDecodeError) as e:
            raise bad_request(f"couldn't get version/kind; json parse error: {e}") from None

    # -- routes ------------------------------------------------------------------------------

    def _route(self, method: str, path: str, query: dict, body: bytes) -> None:
        cluster = self.server.cluster
        if path in ("/healthz", "/livez", "/readyz", "/version"):
            if path == "/version":
                self._record = {"verb": "get", "resource": None, "subresource": None,
                                "namespace": None, "name": None, "path": path}
            if self._authorized() is False:
                raise unauthorized()
            if method != "GET":
                raise method_not_allowed()
            if path == "/version":
                self._send_json(200, version_info(cluster.kubernetes_version))
            else:
                self._send_bytes(200, "text/plain; charset=utf-8", b"ok")
            return
        if path == "/_test" or path.startswith("/_test/"):
            if self._authorized() is not True:
                raise unauthorized()
            self._test(method, path.split("/")[2:], body)
            return
        parts = [urllib.parse.unquote(p) for p in path.split("/")[1:]]
        if parts and parts[0] in ("api", "apis"):
            self._api(method, parts, query, body)
            return
        if self._authorized() is not True:
            raise unauthorized()
        raise path_not_found()

    def _api(self, method: str, parts: list[str], query: dict, body: bytes) -> None:
        cluster = self.server.cluster
        info = parse_api_path(parts, method, query)
        self._record = {"verb": info["verb"], "resource": info["resource"],
                        "subresource": info["subresource"], "namespace": info["namespace"],
                        "name": info["name"], "path": "/" + "/".join(parts)}
        if self._authorized() is not True:
            raise unauthorized()
        kind = info["kind"]
        if kind in ("api", "apis", "discovery"):
            if method != "GET":
                raise method_not_allowed()
            if kind == "api":
                self._send_json(200, {"kind": "APIVersions", "versions": ["v1"],
                                      "serverAddressByClientCIDRs": [
                                          {"clientCIDR": "0.0.0.0/0",
                                           "serverAddress": f"127.0.0.1:{cluster.port}"}]})
            elif kind == "apis":
                self._send_json(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": []})
            else:
                self._send_json(200, API_RESOURCES)
            return
        if kind != "resource":
            raise path_not_found()
        res, sub, ns, name, verb = (info["resource"], info["subresource"], info["namespace"],
                                    info["name"], info["verb"])
        if res not in KINDS:
            raise path_not_found()
        if res != "namespaces" and NAMESPACED[res] != (ns is not None) and \
                not (NAMESPACED[res] and ns is None and name is None):
            raise path_not_found()
        if sub is not None:
            if (res, sub) not in SUBRESOURCE_VERBS or name is None:
                raise path_not_found()
            if verb not in SUBRESOURCE_VERBS[(res, sub)]:
                raise method_not_allowed()
        elif verb not in RESOURCE_VERBS[res] and not (verb == "watch" and res != "namespaces"):
            raise method_not_allowed()
        if res == "namespaces" and name is None:
            raise method_not_allowed()
        if NAMESPACED[res] and ns is None and verb not in ("list", "watch"):
            raise method_not_allowed()
        if cluster.rbac_rules is not None and not self._inspecting() and \
                (ns is None or not rbac_allows(cluster.rbac_rules, verb, res, sub, name)):
            err = forbidden(cluster.rbac_user, verb, res, sub, name, ns)
            LOG.warning("rbac: %s", err.message)
            raise err
        dry_run = query.get("dryRun") == "All"
        if res == "namespaces":
            self._send_json(200, cluster.namespace(name))
        elif sub == "log":
            self._logs(ns, name, query)
        elif verb == "get":
            self._send_json(200, cluster.get(res, ns, name))
        elif verb == "list":
            self._send_json(200, cluster.list(res, ns, query))
        elif verb == "watch":
            self._watch(res, ns, name, query)
        elif verb == "create":
            if name is not None:
                raise method_not_allowed()
            self._send_json(201, cluster.create(res, ns, self._json_body(body), dry_run))
        elif verb == "update":
            self._send_json(200, cluster.update(res, ns, name, self._json_body(body), dry_run))
        elif verb == "patch":
            code, obj = cluster.patch(res, ns, name, self.headers.get("Content-Type", ""), body,
                                      query)
            self._send_json(code, obj)
        elif verb in ("delete", "deletecollection"):
            opts = self._delete_options(body, query)
            dry_run = dry_run or "All" in (opts.get("dryRun") or [])
            if verb == "delete":
                self._send_json(200, cluster.delete(res, ns, name, opts, dry_run))
            else:
                self._send_json(200, cluster.delete_collection(res, ns, query, opts, dry_run))
        else:
            raise method_not_allowed()

    def _delete_options(self, body: bytes, query: dict) -> dict:
        opts = {}
        if body.strip():
            opts = self._json_body(body)
            if not isinstance(opts, dict):
                raise bad_request("DeleteOptions must be a JSON object")
        if "gracePeriodSeconds" in query:
            opts["gracePeriodSeconds"] = query["gracePeriodSeconds"]
        if "propagationPolicy" in query:
            opts["propagationPolicy"] = query["propagationPolicy"]
        grace = opts.get("gracePeriodSeconds")
        if grace is not None:
            try:
                opts["gracePeriodSeconds"] = int(grace)
            except (TypeError, ValueError):
                raise bad_request(f"invalid gracePeriodSeconds: {grace!r}") from None
        return opts

    def _watch(self, resource: str, ns: str | None, name: str | None, query: dict) -> None:
        cluster = self.server.cluster
        lsel = parse_label_selector(query.get("labelSelector", ""))
        fsel = parse_field_selector(resource, query.get("fieldSelector", ""))
        if name:
            fsel = fsel + [("metadata.name", True, name)]
        rv_param = query.get("resourceVersion", "")
        if rv_param not in ("", "0") and not rv_param.isdigit():
            raise bad_request(f'resourceVersion: Invalid value: "{rv_param}": must be a '
                              'non-negative integer')
        try:
            timeout = int(query.get("timeoutSeconds") or 0)
        except ValueError:
            raise bad_request(f"invalid timeoutSeconds: {query.get('timeoutSeconds')!r}") from None
        if timeout <= 0 or timeout > MAX_WATCH_SECONDS:
            timeout = MAX_WATCH_SECONDS
        bookmarks = truthy(query.get("allowWatchBookmarks"))
        send_initial = truthy(query.get("sendInitialEvents"))
        kind = KINDS[resource]
        initial, last_rv, expired = cluster.watch_start(resource, ns, lsel, fsel, rv_param,
                                                        send_initial)

        def matches(obj: dict) -> bool:
            return (ns is None or obj["metadata"].get("namespace") == ns) and \
                labels_match(lsel, obj["metadata"].get("labels")) and fields_match(fsel, obj)

        def event(etype: str, obj: dict) -> bytes:
            return (json.dumps({"type": etype, "object": obj}, separators=(",", ":")) + "\n").encode()

        def bookmark(rv: int, annotations: dict | None = None) -> bytes:
            md = {"resourceVersion": str(rv)}
            if annotations:
                md["annotations"] = annotations
            return event("BOOKMARK", {"kind": kind, "apiVersion": "v1", "metadata": md})

        self._start_chunked(200, "application/json")
        started = time.monotonic()
        sent = 0
        try:
            if expired is not None:
                self._chunk(event("ERROR", expired))
                self._end_chunked()
                return
            for obj in initial:
                self._chunk(event("ADDED", obj))
                sent += 1
            if send_initial:
                self._chunk(bookmark(last_rv, {"k8s.io/initial-events-end": "true"}))
            deadline = started + timeout
            next_bookmark = started + BOOKMARK_INTERVAL
            next_probe = started + 1.0
            while True:
                now = time.monotonic()
                if now >= deadline:
                    break
                wait = min(deadline - now, max(next_probe - now, 0.05),
                           max(next_bookmark - now, 0.05) if bookmarks else 1.0)
                events, cur, expired, stopping = cluster.watch_next(last_rv, wait)
                if stopping:
                    break
                if expired is not None:
                    self._chunk(event("ERROR", expired))
                    break
                for _, etype, res, old, new in events:
                    if res != resource:
                        continue
                    if etype == "ADDED":
                        out = "ADDED" if matches(new) else None
                    elif etype == "DELETED":
                        out = "DELETED" if matches(old) else None
                    else:
                        was, now_matches = matches(old), matches(new)
                        out = ("MODIFIED" if was and now_matches else "ADDED" if now_matches
                               else "DELETED" if was else None)
                    if out:
                        self._chunk(event(out, new))
                        sent += 1
                last_rv = cur
                now = time.monotonic()
                if bookmarks and now >= next_bookmark:
                    self._chunk(bookmark(last_rv))
                    next_bookmark = now + BOOKMARK_INTERVAL
                if now >= next_probe:
                    if self._client_gone():
                        self.close_connection = True
                        LOG.info("watch %s: client went away", self.path)
                        return
                    next_probe = now + 1.0
            self._end_chunked()
        except (ConnectionError, TimeoutError, OSError):
            self.close_connection = True
            LOG.info("watch %s: client went away", self.path)
            return
        LOG.info("watch %s ended after %.1fs, %d event(s)", self.path,
                 time.monotonic() - started, sent)

    def _logs(self, ns: str, name: str, query: dict) -> None:
        cluster = self.server.cluster
        path, uid = cluster.log_source(ns, name, query.get("container"))
        try:
            tail = int(query["tailLines"]) if query.get("tailLines") else None
            limit = int(query["limitBytes"]) if query.get("limitBytes") else None
        except ValueError:
            raise bad_request("tailLines and limitBytes must be integers") from None
        with open(path, "rb") as f:
            data = f.read()
            if tail is not None:
                data = b"".join(data.splitlines(keepends=True)[-tail:]) if tail > 0 else b""
            if limit is not None:
                data = data[:limit]
            if not truthy(query.get("follow")):
                self._send_bytes(200, "text/plain", data)
                return
            self._start_chunked(200, "text/plain")
            try:
                self._chunk(data)
                sent = len(data)
                while limit is None or sent < limit:
                    more = f.read(65536)
                    if limit is not None:
                        more = more[:limit - sent]
                    if more:
                        self._chunk(more)
                        sent += len(more)
                        continue
                    if not cluster.log_live(ns, name, uid):
                        rest = f.read()
                        self._chunk(rest if limit is None else rest[:limit - sent])
                        break
                    if self._client_gone():
                        self.close_connection = True
                        return
                    time.sleep(0.1)
                self._end_chunked()
            except (ConnectionError, TimeoutError, OSError):
                self.close_connection = True

    def _test(self, method: str, parts: list[str], body: bytes) -> None:
        cluster = self.server.cluster
        if parts == ["requests"]:
            if method != "GET":
                raise method_not_allowed()
            with cluster.cond:
                requests = [dict(r) for r in cluster.requests]
            self._send_json(200, requests)
        elif parts == ["nodes"]:
            if method != "POST":
                raise method_not_allowed()
            self._send_json(201, cluster.add_node(self._json_body(body)))
        elif len(parts) == 2 and parts[0] == "nodes":
            if method != "DELETE":
                raise method_not_allowed()
            self._send_json(200, cluster.remove_node(urllib.parse.unquote(parts[1])))
        elif len(parts) == 3 and parts[0] == "evict":
            if method != "POST":
                raise method_not_allowed()
            self._send_json(200, cluster.evict(urllib.parse.unquote(parts[1]),
                                               urllib.parse.unquote(parts[2])))
        else:
            raise path_not_found()


# ---------------------------------------------------------------------------------------------
# main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="A Kubernetes API-shaped test server (not a real API server) for gpuci tests.")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1; 0 picks one")
    parser.add_argument("--token", required=True, help="the bearer token every request must carry")
    parser.add_argument("--nodes", help="JSON file with the list of simulated nodes")
    parser.add_argument("--log-dir", required=True,
                        help="where pod logs (<ns>_<pod>.log) and pod home directories go")
    parser.add_argument("--kubernetes-version", default="1.30.0",
                        help="reported by /version; picks the validation schemas")
    parser.add_argument("--rbac", help="YAML file with one Role; requests it does not grant get 403")
    parser.add_argument("--rbac-user", default="system:serviceaccount:default:gpuci",
                        help="the user named in 403 messages")
    parser.add_argument("--history-limit", type=int, default=HISTORY_LIMIT,
                        help="watch events kept for replay; older resourceVersions get 410 Expired")
    parser.add_argument("--runtime-classes",
                        help="comma-separated RuntimeClass names the cluster has; a pod naming "
                             "another is refused with 403 as the RuntimeClass admission plugin does "
                             "(default: every name is accepted)")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)

    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG if args.verbose else logging.INFO,
                        format="kube-testserver %(asctime)s %(levelname)s %(message)s")
    schema_version = pick_schema_version(args.kubernetes_version)
    LOG.info("validating objects with kubernetes-validate %s, schemas for Kubernetes %s "
             "(the nearest shipped to the requested %s)", kubernetes_validate.__version__,
             schema_version, args.kubernetes_version)
    rules = load_rbac(args.rbac) if args.rbac else None
    if rules is not None:
        LOG.info("rbac: %d rule(s) from %s for user %s", len(rules), args.rbac, args.rbac_user)
    os.makedirs(args.log_dir, exist_ok=True)
    log_dir = os.path.abspath(args.log_dir)
    cluster = Cluster(schema_version=schema_version, kubernetes_version=args.kubernetes_version,
                      log_dir=log_dir, rbac_rules=rules, rbac_user=args.rbac_user,
                      history_limit=max(args.history_limit, 1),
                      runtime_classes=(None if args.runtime_classes is None else
                                       {c.strip() for c in args.runtime_classes.split(",") if c.strip()}))
    if args.nodes:
        with open(args.nodes) as f:
            nodes = json.load(f)
        if not isinstance(nodes, list):
            raise SystemExit(f"--nodes {args.nodes}: expected a JSON list of nodes")
        for raw in nodes:
            try:
                cluster.add_node(raw)
            except ApiError as e:
                raise SystemExit(f"--nodes {args.nodes}: {e.message}") from None

    cluster.watchdog = Watchdog()
    if not cluster.namespaces:
        LOG.warning("not running as root: every pod runs as a plain process (no namespaces, masked "
                    "paths, capability bounding set or user namespace; README: Containers)")
    with open("/proc/self/mounts") as m, open("/proc/self/cgroup") as c:
        cluster.pod_cgroups = PodCgroups(m.read(), c.read())
    for b in cluster.pod_cgroups.bases:
        cluster.watchdog.cgroup(b)
    if cluster.pod_cgroups.bases:
        LOG.info("pod cgroups (memory limit, pids) under %s", ", ".join(cluster.pod_cgroups.bases))
    else:
        LOG.warning("pods run without cgroups of their own (no memory limit inside): %s",
                    cluster.pod_cgroups.why_not)
    server = Server(("127.0.0.1", args.port), cluster, args.token)
    cluster.port = server.server_address[1]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    parent = os.getppid()

    def watch_parent() -> None:
        while not stop.wait(0.5):
            if os.getppid() != parent:
                LOG.warning("parent process %d is gone; shutting down", parent)
                stop.set()

    def controller() -> None:
        while True:
            with cluster.cond:
                if cluster.stopping:
                    return
                try:
                    cluster.reconcile()
                except Exception:
                    LOG.exception("controller pass failed")
                cluster.cond.wait(TICK)

    threads = [threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                name="http", daemon=True),
               threading.Thread(target=controller, name="controller", daemon=True),
               threading.Thread(target=watch_parent, name="parent-watch", daemon=True)]
    for t in threads:
        t.start()
    print(f"listening on 127.0.0.1:{cluster.port}", flush=True)
    sys.stdout = sys.stderr   # stdout carries exactly one line
    LOG.info("serving on 127.0.0.1:%d, %d node(s), logs in %s", cluster.port,
             len(cluster.node_cfg), log_dir)
    while not stop.wait(0.5):
        pass
    LOG.info("shutting down")
    cluster.kill_everything()
    server.shutdown()
    server.close_connections()
    server.server_close()
    for t in threads:
        t.join(timeout=2)
    LOG.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
