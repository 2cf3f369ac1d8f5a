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
                    fail(f"for 'Gt', 'Lt' operators, the value must be an integer")
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
                    fail(f"for 'in', 'notin' operators, values set can't be empty")
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
    return errs


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


NODE_KEYS = {"name", "labels", "taints", "gpus", "gpu_uuids", "cpu", "memory", "runtime_classes"}


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
    classes = raw.get("runtime_classes", ["nvidia"])
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise ValueError(f"node {name}: runtime_classes must be a list of names")
    return {"name": name, "labels": dict(labels), "taints": [dict(t) for t in taints],
            "gpus": gpus, "gpu_uuids": list(uuids), "cpu": cpu, "memory": memory,
            "runtime_classes": list(classes), "has_gpu_key": "gpus" in raw}


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

    def cond(kind: str, status: str, reason: str, message: str) -> dict:
        return {"type": kind, "status": status, "lastHeartbeatTime": now,
                "lastTransitionTime": now, "reason": reason, "message": message}

    return {
        "kind": "Node", "apiVersion": "v1",
        "metadata": {"name": name, "uid": str(uuid.uuid4()), "creationTimestamp": now,
                     "labels": labels,
                     "annotations": {"testserver.gpuci/gpu-uuids": ",".join(cfg["gpu_uuids"])}},
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
