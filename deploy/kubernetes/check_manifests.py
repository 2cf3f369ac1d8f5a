#!/usr/bin/env python3
"""Check the Kubernetes manifests under deploy/kubernetes without a cluster.

Every YAML document (base, examples, patches) is validated against the official JSON schemas
that the `kubernetes-validate` package ships, strictly (unknown fields are errors), for one
Kubernetes version. On top of the schemas, the rules gpuci's deployment depends on:

- every namespaced object names its namespace, one the manifests create;
- nothing cluster-scoped is granted: no ClusterRole or ClusterRoleBinding at all;
- a Role grants exactly what the kubernetes provider uses in the runner namespace
  (pods: create get list watch delete; secrets: create delete), no `*`, nothing else;
- its RoleBinding binds it to the coordinator's service account and to nothing else;
- the runner service account mounts no token (jobs run in its pods);
- the server.toml in the coordinator's ConfigMap parses as TOML and has a kubernetes fleet
  whose settings name the runner namespace, the runner service account and a Service the
  manifests define (host and port);
- the coordinator's Deployment is one Recreate replica, hardened, probed on /healthz and
  /readyz, and what it refers to (service account, ConfigMap, claim, Service) exists;
- each kustomization.yaml lists files that exist and every manifest file beside it, and each
  patch without a target matches an object of its bases;
- where `kubectl` is on PATH, each kustomization also renders (`kubectl kustomize`) and the
  rendered objects pass the same checks.

Run with the venv that has kubernetes-validate:

    /var/tmp/gpuci-kube-venv/bin/python deploy/kubernetes/check_manifests.py

Prints one line per file checked on stdout; exit 0 when all pass, 1 when a manifest fails
(each problem names the file, the document's index, 1-based, and what is wrong), 2 when the
check cannot run (kubernetes-validate missing, a version it does not ship).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tomllib
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

try:
    import yaml
    import kubernetes_validate
    from kubernetes_validate.utils import all_versions
except ImportError as e:  # pragma: no cover - depends on the environment
    sys.exit(
        f"error: {e.name} is missing. Create the venv and run the check with it:\n"
        "  python3 -m venv /var/tmp/gpuci-kube-venv\n"
        "  /var/tmp/gpuci-kube-venv/bin/pip install -q kubernetes-validate\n"
        f"  /var/tmp/gpuci-kube-venv/bin/python {sys.argv[0]}"
    )

ROOT = Path(__file__).resolve().parent

COORDINATOR_NS = "gpuci"
COORDINATOR_SA = "gpuci-coordinator"
COORDINATOR_DEPLOYMENT = "gpuci-coordinator"
RUNNER_NS = "gpuci-runners"
RUNNER_SA = "gpuci-runner"
SERVER_CONFIG = "gpuci-server-config"

# What the kubernetes provider does in the runner namespace, and all it may do there.
PROVIDER_RULES = {
    ("", "pods"): {"create", "get", "list", "watch", "delete"},
    ("", "secrets"): {"create", "delete"},
}

# Kinds without a namespace that could turn up here; anything else must name one.
CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass",
    "RuntimeClass", "PriorityClass", "IngressClass", "CustomResourceDefinition",
    "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration", "APIService",
}

KUSTOMIZATION_NAMES = {"kustomization.yaml", "kustomization.yml", "Kustomization"}


@dataclass
class Doc:
    """One YAML document and where it came from."""
    file: str          # relative to ROOT, or `render of DIR`
    index: int         # 1-based position among the file's documents
    body: dict

    @property
    def kind(self) -> str:
        return str(self.body.get("kind", "?"))

    @property
    def name(self) -> str:
        return str((self.body.get("metadata") or {}).get("name", "?"))

    @property
    def namespace(self) -> str | None:
        return (self.body.get("metadata") or {}).get("namespace")

    def key(self) -> tuple[str, str | None, str]:
        return (self.kind, self.namespace, self.name)

    def where(self) -> str:
        ns = f"{self.namespace}/" if self.namespace else ""
        return f"{self.file}: document {self.index} ({self.kind} {ns}{self.name})"


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)

    def fail(self, doc: Doc, what: str) -> None:
        self.problems.append(f"{doc.where()}: {what}")

    def fail_file(self, file: str, what: str) -> None:
        self.problems.append(f"{file}: {what}")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def pick_version(asked: str) -> str:
    """The shipped schema version nearest to `asked` (ties: the older one)."""
    def minor_number(v: str) -> int:
        major, minor = v.lstrip("v").split(".")[:2]
        return int(major) * 1000 + int(minor)

    want = minor_number(asked)
    shipped = all_versions()
    return min(shipped, key=lambda v: (abs(minor_number(v) - want), minor_number(v)))


class _NoDuplicateKeys(yaml.SafeLoader):
    """A loader that refuses a key given twice in one mapping: PyYAML keeps the last, kubectl
    and kustomize may keep another, and either way one of them is lost (the privileged
    example's ConfigMap had two `data:` keys, and its server.toml went missing)."""


def _mapping_without_duplicates(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"the key {key!r} is given twice", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_NoDuplicateKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_docs(path: Path, report: Report) -> list[Doc]:
    try:
        raw = list(yaml.load_all(path.read_text(), Loader=_NoDuplicateKeys))
    except (OSError, yaml.YAMLError) as e:
        report.fail_file(rel(path), f"cannot read YAML: {e}")
        return []
    docs = []
    for i, body in enumerate(raw, start=1):
        if body is None:
            continue
        if not isinstance(body, dict):
            report.fail_file(rel(path), f"document {i}: expected a mapping, got {type(body).__name__}")
            continue
        docs.append(Doc(rel(path), i, body))
    return docs


# --- checks of one document ------------------------------------------------------------------

def check_schema(doc: Doc, version: str, report: Report) -> None:
    try:
        kubernetes_validate.validate(doc.body, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path) or "(top)"
        report.fail(doc, f"schema {e.version}: {where}: {e.message}")
    except kubernetes_validate.SchemaNotFoundError as e:
        report.fail(doc, e.message)
    except KeyError as e:
        report.fail(doc, f"missing {e.args[0]}")


def check_namespace(doc: Doc, namespaces: set[str], report: Report) -> None:
    if doc.kind in CLUSTER_SCOPED:
        if doc.namespace:
            report.fail(doc, f"{doc.kind} is cluster-scoped but names namespace {doc.namespace}")
        return
    if not doc.namespace:
        report.fail(doc, "metadata.namespace: a namespaced object must name its namespace")
    elif doc.namespace not in namespaces:
        report.fail(doc, f"metadata.namespace: {doc.namespace} is none of the namespaces created here "
                         f"({', '.join(sorted(namespaces)) or 'none'})")


def check_rbac(doc: Doc, report: Report) -> None:
    if doc.kind in ("ClusterRole", "ClusterRoleBinding"):
        report.fail(doc, "nothing cluster-scoped is granted: the provider works in the runner namespace only")
    elif doc.kind == "Role":
        check_role(doc, report)
    elif doc.kind == "RoleBinding":
        check_role_binding(doc, report)


def check_role(doc: Doc, report: Report) -> None:
    if doc.namespace != RUNNER_NS:
        report.fail(doc, f"the provider's Role belongs in {RUNNER_NS}")
    granted: dict[tuple[str, str], set[str]] = {}
    for i, rule in enumerate(doc.body.get("rules") or []):
        at = f"rules[{i}]"
        for key in ("resourceNames", "nonResourceURLs"):
            if rule.get(key):
                report.fail(doc, f"{at}.{key}: not expected ({key} is not how the provider is limited)")
        groups, resources, verbs = (rule.get(k) or [] for k in ("apiGroups", "resources", "verbs"))
        for value in (*groups, *resources, *verbs):
            if "*" in str(value):
                report.fail(doc, f"{at}: wildcard {value!r}: grant named verbs on named resources")
        for g in groups:
            for r in resources:
                granted.setdefault((g, r), set()).update(verbs)
    for (group, resource), verbs in sorted(granted.items()):
        name = f"{group}/{resource}" if group else resource
        wanted = PROVIDER_RULES.get((group, resource))
        if wanted is None:
            report.fail(doc, f"grants {name} ({', '.join(sorted(verbs))}): the provider uses only "
                             "pods and secrets of the core group")
            continue
        if extra := verbs - wanted:
            report.fail(doc, f"{name}: grants {', '.join(sorted(extra))}, which the provider does not use")
        if missing := wanted - verbs:
            report.fail(doc, f"{name}: lacks {', '.join(sorted(missing))}, which the provider needs")
    for (group, resource) in PROVIDER_RULES.keys() - granted.keys():
        report.fail(doc, f"grants nothing on {resource}: the provider needs "
                         f"{', '.join(sorted(PROVIDER_RULES[(group, resource)]))}")


def check_role_binding(doc: Doc, report: Report) -> None:
    ref = doc.body.get("roleRef") or {}
    if ref.get("kind") != "Role":
        report.fail(doc, f"roleRef.kind: {ref.get('kind')!r}; bind the namespace's Role, not a ClusterRole")
    subjects = [(s.get("kind"), s.get("namespace"), s.get("name")) for s in doc.body.get("subjects") or []]
    wanted = [("ServiceAccount", COORDINATOR_NS, COORDINATOR_SA)]
    if subjects != wanted:
        report.fail(doc, f"subjects: {subjects}; expected only the coordinator's service account "
                         f"{COORDINATOR_NS}/{COORDINATOR_SA}")


def check_runner_account(doc: Doc, report: Report) -> None:
    if doc.kind == "ServiceAccount" and doc.name == RUNNER_SA:
        if doc.body.get("automountServiceAccountToken") is not False:
            report.fail(doc, "automountServiceAccountToken: must be false, jobs run in the runner's pods")


def kubernetes_fleets(doc: Doc) -> tuple[list[dict], str | None]:
    """The kubernetes fleets of the server.toml in the coordinator's ConfigMap, or why there
    is no such file; ([], None) for any other document."""
    if doc.kind != "ConfigMap" or doc.name != SERVER_CONFIG:
        return [], None
    text = (doc.body.get("data") or {}).get("server.toml")
    if not isinstance(text, str):
        return [], "data.server.toml: missing"
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        return [], f"data.server.toml: not TOML: {e}"
    fleets = config.get("fleet", [])
    if not isinstance(fleets, list):
        return [], "data.server.toml: `fleet` must be an array of tables ([[fleet]])"
    return [f for f in fleets if isinstance(f, dict) and f.get("provider") == "kubernetes"], None


def check_server_config(doc: Doc, report: Report) -> None:
    if doc.kind != "ConfigMap" or doc.name != SERVER_CONFIG:
        return
    fleets, unreadable = kubernetes_fleets(doc)
    if unreadable:
        report.fail(doc, unreadable)
        return
    if not fleets:
        report.fail(doc, 'data.server.toml: no [[fleet]] with provider = "kubernetes"')
    for f in fleets:
        settings = f.get("settings") or {}
        at = f"data.server.toml: fleet {f.get('name', '?')}: settings"
        for key, wanted in (("namespace", RUNNER_NS), ("service_account", RUNNER_SA)):
            if settings.get(key) != wanted:
                report.fail(doc, f"{at}.{key}: {settings.get(key)!r}, expected {wanted!r}")
        if not settings.get("image"):
            report.fail(doc, f"{at}.image: missing")


def check_doc(doc: Doc, version: str, namespaces: set[str], report: Report) -> None:
    check_schema(doc, version, report)
    check_namespace(doc, namespaces, report)
    check_rbac(doc, report)
    check_runner_account(doc, report)
    check_server_config(doc, report)


# --- checks across documents -----------------------------------------------------------------

def check_objects(label: str, objects: list[Doc], report: Report, extra_configs: list[Doc] = ()) -> None:
    """References between the objects of one set (a kustomization's resources, or its
    rendering), `label` in problems of the set as a whole: the objects gpuci needs are there,
    the fleet names a Service of the set, the Deployment's account, volumes and Service and
    the RoleBinding's Role exist. `extra_configs`: ConfigMap patches, whose fleets are
    checked against the set too."""
    index: dict[tuple, Doc] = {}
    for o in objects:
        if o.key() in index:
            report.fail(o, f"also defined at {index[o.key()].where()}")
        index.setdefault(o.key(), o)
    has = lambda kind, ns, name: (kind, ns, name) in index  # noqa: E731

    for kind, ns, name in (("ServiceAccount", RUNNER_NS, RUNNER_SA),
                           ("ServiceAccount", COORDINATOR_NS, COORDINATOR_SA),
                           ("Deployment", COORDINATOR_NS, COORDINATOR_DEPLOYMENT),
                           ("ConfigMap", COORDINATOR_NS, SERVER_CONFIG)):
        if not has(kind, ns, name):
            report.fail_file(label, f"no {kind} {ns}/{name} among its objects")
    if not any(o.kind == "Role" and o.namespace == RUNNER_NS for o in objects):
        report.fail_file(label, f"no Role for the provider in {RUNNER_NS}")

    for o in objects:
        if o.kind == "RoleBinding":
            ref = o.body.get("roleRef") or {}
            if ref.get("kind") == "Role" and not has("Role", o.namespace, ref.get("name")):
                report.fail(o, f"roleRef: no Role {o.namespace}/{ref.get('name')} here")
        elif o.kind == "Deployment" and o.name == COORDINATOR_DEPLOYMENT:
            check_coordinator(o, has, report)
        elif o.kind == "Service":
            check_service(o, objects, report)

    for o in [*objects, *extra_configs]:
        for f in kubernetes_fleets(o)[0]:  # an unreadable file is reported per document
            check_fleet_server(o, f, index, report)


def check_fleet_server(doc: Doc, fleet: dict, index: dict, report: Report) -> None:
    at = f"data.server.toml: fleet {fleet.get('name', '?')}: settings.server"
    url = (fleet.get("settings") or {}).get("server", "")
    parsed = urllib.parse.urlsplit(str(url))
    labels = (parsed.hostname or "").split(".")
    if parsed.scheme not in ("http", "https") or len(labels) < 3 or labels[2] != "svc":
        report.fail(doc, f"{at}: {url!r}; expected http://SERVICE.NAMESPACE.svc:PORT")
        return
    service = index.get(("Service", labels[1], labels[0]))
    if service is None:
        report.fail(doc, f"{at}: {url!r} names Service {labels[1]}/{labels[0]}, which is not defined here")
        return
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    ports = [p.get("port") for p in (service.body.get("spec") or {}).get("ports") or []]
    if port not in ports:
        report.fail(doc, f"{at}: port {port}, but Service {labels[1]}/{labels[0]} serves {ports}")


def check_coordinator(doc: Doc, has, report: Report) -> None:
    spec = doc.body.get("spec") or {}
    if spec.get("replicas", 1) != 1:
        report.fail(doc, "spec.replicas: one coordinator owns the data dir; use 1")
    if (spec.get("strategy") or {}).get("type") != "Recreate":
        report.fail(doc, "spec.strategy.type: Recreate, so two coordinators never want one data dir")
    pod = (spec.get("template") or {}).get("spec") or {}
    account = pod.get("serviceAccountName")
    if account != COORDINATOR_SA or not has("ServiceAccount", doc.namespace, account):
        report.fail(doc, f"serviceAccountName: {account!r}; expected {COORDINATOR_SA} (defined here)")
    pod_sc = pod.get("securityContext") or {}
    for v in pod.get("volumes") or []:
        if "configMap" in v and not has("ConfigMap", doc.namespace, v["configMap"].get("name")):
            report.fail(doc, f"volume {v.get('name')}: no ConfigMap {v['configMap'].get('name')} here")
        claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
        if claim and not has("PersistentVolumeClaim", doc.namespace, claim):
            report.fail(doc, f"volume {v.get('name')}: no PersistentVolumeClaim {claim} here")
    for c in pod.get("containers") or []:
        at = f"container {c.get('name')}"
        sc = c.get("securityContext") or {}
        hardening = {
            "runAsNonRoot": sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True,
            "readOnlyRootFilesystem": sc.get("readOnlyRootFilesystem") is True,
            "allowPrivilegeEscalation: false": sc.get("allowPrivilegeEscalation") is False,
            "capabilities.drop [ALL]": "ALL" in ((sc.get("capabilities") or {}).get("drop") or []),
            "seccompProfile RuntimeDefault":
                (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type") == "RuntimeDefault",
        }
        for what, ok in hardening.items():
            if not ok:
                report.fail(doc, f"{at}: securityContext lacks {what}")
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            got = ((c.get(probe) or {}).get("httpGet") or {}).get("path")
            if got != path:
                report.fail(doc, f"{at}: {probe}: GET {got!r}, expected {path}")
        resources = c.get("resources") or {}
        if not resources.get("requests") or not resources.get("limits"):
            report.fail(doc, f"{at}: resources: give requests and limits")


def check_service(doc: Doc, objects: list[Doc], report: Report) -> None:
    spec = doc.body.get("spec") or {}
    selector = spec.get("selector") or {}
    pods = [
        (o, ((o.body.get("spec") or {}).get("template") or {}))
        for o in objects if o.kind == "Deployment" and o.namespace == doc.namespace
    ]
    matching = [
        (o, t) for o, t in pods
        if selector and all(((t.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in selector.items())
    ]
    if not matching:
        report.fail(doc, f"spec.selector {selector} selects no Deployment's pods in {doc.namespace}")
        return
    port_names = {p.get("name") for _, t in matching for c in (t.get("spec") or {}).get("containers") or []
                  for p in c.get("ports") or []}
    for p in spec.get("ports") or []:
        target = p.get("targetPort")
        if isinstance(target, str) and target not in port_names:
            report.fail(doc, f"port {p.get('port')}: targetPort {target!r} is no container port's name")


# --- kustomizations --------------------------------------------------------------------------

@dataclass
class Kustomization:
    path: Path
    resources: list[Path]
    patches: list[Path]    # strategic-merge patches that name their object themselves
    targeted: list[Path]   # patches applied to a `target` (JSON 6902 or not): rendering checks them


def load_kustomization(path: Path, report: Report) -> Kustomization | None:
    docs = load_docs(path, report)
    if len(docs) != 1:
        report.fail_file(rel(path), "expected exactly one YAML document")
        return None
    body = docs[0].body
    here = path.parent
    resources, patches, targeted = [], [], []
    for entry in map(str, body.get("resources") or []):
        if "://" in entry or entry.startswith(("github.com/", "git@")):
            report.fail_file(rel(path), f"resources: {entry}: remote resources cannot be checked here")
            continue
        target = (here / entry).resolve()
        if target.is_file():
            resources.append(target)
        elif target.is_dir() and any((target / n).is_file() for n in KUSTOMIZATION_NAMES):
            resources.append(target)
        else:
            report.fail_file(rel(path), f"resources: {entry}: no such file, nor a directory with a kustomization")
    entries = [(p, "patches") for p in body.get("patches") or []]
    entries += [({"path": p}, "patchesStrategicMerge") for p in body.get("patchesStrategicMerge") or []]
    for entry, key in entries:
        if not isinstance(entry, dict) or "path" not in entry:
            continue  # an inline patch: rendering checks it
        target = (here / str(entry["path"])).resolve()
        if not target.is_file():
            report.fail_file(rel(path), f"{key}: {entry['path']}: no such file")
        else:
            (targeted if "target" in entry else patches).append(target)
    listed = set(resources) | set(patches) | set(targeted)
    for f in sorted(here.iterdir()):
        if f.suffix in (".yaml", ".yml") and f.name not in KUSTOMIZATION_NAMES and f.resolve() not in listed:
            report.fail_file(rel(path), f"{f.name} is not listed, so `kubectl apply -k` leaves it out")
    return Kustomization(path, resources, patches, targeted)


def base_objects(k: Kustomization, kustomizations: dict[Path, Kustomization],
                 docs: dict[Path, list[Doc]], seen: frozenset = frozenset()) -> list[Doc]:
    """The objects a kustomization's resources define, through nested bases (patches aside)."""
    out = []
    for r in k.resources:
        if r.is_file():
            out.extend(docs.get(r, []))
        else:
            inner = next((kustomizations[r / n] for n in KUSTOMIZATION_NAMES if r / n in kustomizations), None)
            if inner is not None and r not in seen:
                out.extend(base_objects(inner, kustomizations, docs, seen | {r}))
    return out


def render(directory: Path, kubectl: str, version: str, namespaces: set[str], report: Report) -> int | None:
    """`kubectl kustomize DIR`; its objects pass every check. The number of objects, or None."""
    label = f"render of {rel(directory)}"
    run = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True)
    if run.returncode != 0:
        report.fail_file(label, f"kubectl kustomize failed: {run.stderr.strip()}")
        return None
    objects = [Doc(label, i, b) for i, b in enumerate(yaml.safe_load_all(run.stdout), start=1) if b]
    for o in objects:
        check_doc(o, version, namespaces, report)
    check_objects(label, objects, report)
    return len(objects)


# --- main ------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubernetes-version", default="1.30.0",
                        help="validate against this version's schemas (the nearest shipped one); default 1.30.0")
    parser.add_argument("--no-render", action="store_true",
                        help="do not render the kustomizations with kubectl even where it is found")
    args = parser.parse_args()
    try:
        version = pick_version(args.kubernetes_version)
    except ValueError:
        print(f"error: --kubernetes-version {args.kubernetes_version!r}: expected e.g. 1.30.0", file=sys.stderr)
        return 2
    print(f"schemas: Kubernetes {version} (kubernetes-validate {kubernetes_validate.__version__}; "
          f"asked for {args.kubernetes_version})", file=sys.stderr)

    report = Report()
    files = sorted(p for p in ROOT.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
    kustomizations = {p.resolve(): load_kustomization(p, report) for p in files if p.name in KUSTOMIZATION_NAMES}
    kustomizations = {p: k for p, k in kustomizations.items() if k is not None}
    targeted = {p for k in kustomizations.values() for p in k.targeted}
    manifests = [p for p in files if p.name not in KUSTOMIZATION_NAMES and p.resolve() not in targeted]
    docs = {p.resolve(): load_docs(p, report) for p in manifests}
    patch_files = {p for k in kustomizations.values() for p in k.patches}

    namespaces = {d.name for ds in docs.values() for d in ds if d.kind == "Namespace"}
    lines = []  # (name, what was checked); problems name the line they belong to
    lines += [(rel(p), "patch with a target: checked by rendering") for p in sorted(targeted)]
    for p in manifests:
        for d in docs[p.resolve()]:
            check_doc(d, version, namespaces, report)
        n = len(docs[p.resolve()])
        role = "patch" if p.resolve() in patch_files else "manifest"
        lines.append((rel(p), f"{role}, {n} document{'s' if n != 1 else ''}, schema {version}"))

    # Each kustomization's objects as a set: references between them, and its patches' targets.
    for path, k in sorted(kustomizations.items()):
        objects = base_objects(k, kustomizations, docs)
        patches = [d for p in k.patches for d in docs.get(p, [])]
        check_objects(rel(path), objects, report, extra_configs=patches)
        keys = {o.key() for o in objects}
        for d in patches:
            if d.key() not in keys:
                report.fail(d, f"patches nothing: no {d.kind} {d.namespace}/{d.name} in {rel(path)}'s resources")
        lines.append((rel(path), f"kustomization, {len(k.resources)} resource(s) and {len(k.patches)} patch(es) found, "
                      f"{len(objects)} object(s)"))

    kubectl = None if args.no_render else shutil.which("kubectl")
    for path in sorted(kustomizations):
        if kubectl is None:
            lines.append((f"render of {rel(path.parent)}", "skipped: " + ("--no-render" if args.no_render else "kubectl not found")))
            continue
        n = render(path.parent, kubectl, version, namespaces, report)
        lines.append((f"render of {rel(path.parent)}",
                      "kubectl kustomize failed" if n is None else f"kubectl kustomize, {n} object(s)"))

    for name, what in lines:
        failing = any(p.startswith(f"{name}:") for p in report.problems)
        print(f"{'FAIL' if failing else 'ok  '} {name} ({what})")
    for problem in dict.fromkeys(report.problems):
        print(f"error: {problem}")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
