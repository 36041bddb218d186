"""Cross-checks of the deployment files that no schema can express.

    python3 infra/deploy/check_manifests.py      # run by infra/deploy/validate.sh

Schemas check each object alone; this checks that the objects agree with each other and
with the code: every Secret, ConfigMap and key a pod or KEDA reads is defined, every job
kind a run publishes has a consumer, each KEDA ScaledObject watches exactly the queues its
Deployment consumes (`<prefix>.<kind>`, the prefix of the queue URL, the kinds of
schemas/src/job.rs), Prometheus annotations name the port the metrics are served on, the
run spec's endpoint is the serve Service, and the image paths name files in the repository.
Prints one line per problem; exits 1 if there is any. Needs PyYAML.
"""

import pathlib
import re
import sys
import tomllib
import urllib.parse

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "infra" / "deploy"
K8S = DEPLOY / "k8s"
IMAGE_EXAMPLES = "/opt/harness-s/examples/"  # where the Dockerfile copies examples/

problems = []


def problem(where, text):
    problems.append(f"{where}: {text}")


def job_kinds():
    """The job kinds of schemas/src/job.rs (`Self::Rollout => "rollout"`), `sleep` apart."""
    text = (ROOT / "schemas" / "src" / "job.rs").read_text()
    kinds = set(re.findall(r'Self::\w+ => "(\w+)"', text))
    if not kinds:
        sys.exit("check_manifests.py: found no job kinds in schemas/src/job.rs")
    kinds.discard("sleep")  # diagnostic jobs of tests and `bench queue`; no run publishes them
    return kinds


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def env_value(container, name):
    e = env_of(container).get(name)
    return None if e is None else e.get("value")


def queue_prefix(url, where):
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    prefix = query.get("prefix", ["harness-s"])[0]  # infra::queue::QueueOptions' default
    if not prefix:
        problem(where, "empty prefix= in the queue URL")
    return prefix


def image_path(path, where):
    """A path inside the image that comes from examples/ must exist in the repository."""
    if path.startswith(IMAGE_EXAMPLES):
        local = ROOT / "examples" / path[len(IMAGE_EXAMPLES):]
        if not local.exists():
            problem(where, f"{path} is not in the image: examples/{path[len(IMAGE_EXAMPLES):]} does not exist")


KINDS = job_kinds()


def consumed(queues, where):
    kinds = {k.strip() for k in (queues or "").split(",") if k.strip()}
    for k in sorted(kinds - KINDS - {"sleep"}):
        problem(where, f"HARNESS_S_WORKER_QUEUES names `{k}`, which is no job kind ({', '.join(sorted(KINDS))})")
    return kinds


# --------------------------------------------------------------------------- Kubernetes
objects = []
for f in sorted(K8S.glob("*.yaml")):
    for doc in yaml.safe_load_all(f.read_text()):
        if doc:
            objects.append((f.name, doc))

by_kind = {}
for fname, o in objects:
    by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = (fname, o)


def data_keys(kind, name):
    entry = by_kind.get(kind, {}).get(name)
    if entry is None:
        return None
    o = entry[1]
    return set(o.get("data", {})) | set(o.get("stringData", {}))


def pod_spec(o):
    if o["kind"] == "CronJob":
        return o["spec"]["jobTemplate"]["spec"]["template"]["spec"], o["spec"]["jobTemplate"]["spec"]["template"]["metadata"]
    return o["spec"]["template"]["spec"], o["spec"]["template"]["metadata"]


workloads = [(f, o) for f, o in objects if o["kind"] in ("Deployment", "Job", "CronJob")]
secret_queue_url = None
for name, (f, o) in by_kind.get("Secret", {}).items():
    url = o.get("stringData", {}).get("url")
    if name == "harness-s-queue" and url:
        secret_queue_url = url
if secret_queue_url is None:
    problem("secrets.yaml", "no Secret harness-s-queue with key `url` (HARNESS_S_QUEUE)")
    prefix = "harness-s"
else:
    prefix = queue_prefix(secret_queue_url, "secrets.yaml harness-s-queue url")

consumers = {}  # Deployment name -> kinds it consumes
for f, o in workloads:
    where = f"{f} {o['kind']}/{o['metadata']['name']}"
    spec, meta = pod_spec(o)
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for v in volumes.values():
        if "configMap" in v and data_keys("ConfigMap", v["configMap"]["name"]) is None:
            problem(where, f"volume {v['name']} mounts ConfigMap {v['configMap']['name']}, which is not defined")
    for c in spec["containers"]:
        cw = f"{where} container {c['name']}"
        for ef in c.get("envFrom", []):
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in ef and data_keys(kind, ef[key]["name"]) is None:
                    problem(cw, f"envFrom {kind} {ef[key]['name']} is not defined")
        for e in c.get("env", []):
            ref = e.get("valueFrom", {})
            for kind, key in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
                if key in ref:
                    keys = data_keys(kind, ref[key]["name"])
                    if keys is None:
                        problem(cw, f"{e['name']} reads {kind} {ref[key]['name']}, which is not defined")
                    elif ref[key]["key"] not in keys:
                        problem(cw, f"{e['name']} reads key {ref[key]['key']} of {kind} {ref[key]['name']}, which has {sorted(keys)}")
        role = (c.get("args") or [None])[0]
        env = env_of(c)
        # every role but serve needs the store and, but for serve, the queue
        if role in ("run", "scheduler", "worker") and "HARNESS_S_QUEUE" not in env:
            problem(cw, f"role {role} without HARNESS_S_QUEUE")
        # the run spec the scheduler submits is the mounted ConfigMap key
        spec_path = env_value(c, "HARNESS_S_SPEC")
        if spec_path:
            mount = next((m for m in c.get("volumeMounts", []) if spec_path.startswith(m["mountPath"].rstrip("/") + "/")), None)
            if mount is None:
                image_path(spec_path, cw)
            else:
                cm = volumes[mount["name"]]["configMap"]["name"]
                key = spec_path[len(mount["mountPath"].rstrip("/")) + 1:]
                if key not in (data_keys("ConfigMap", cm) or set()):
                    problem(cw, f"HARNESS_S_SPEC {spec_path}: ConfigMap {cm} has no key {key}")
        # Prometheus annotations name the port the metrics are served on
        addr = env_value(c, "HARNESS_S_METRICS_ADDR")
        ann = meta.get("annotations", {})
        if addr:
            port = addr.rsplit(":", 1)[1]
            if ann.get("prometheus.io/port") != port:
                problem(cw, f"metrics on {addr} but prometheus.io/port is {ann.get('prometheus.io/port')}")
            if int(port) not in [p["containerPort"] for p in c.get("ports", [])]:
                problem(cw, f"metrics port {port} is not a containerPort")
        elif ann.get("prometheus.io/scrape") == "true":
            problem(cw, "prometheus.io/scrape without HARNESS_S_METRICS_ADDR (harness-s serves metrics only when asked)")
        if role == "worker" and o["kind"] == "Deployment":
            consumers[o["metadata"]["name"]] = (consumed(env_value(c, "HARNESS_S_WORKER_QUEUES"), cw), c)

all_consumed = set().union(*(k for k, _ in consumers.values())) if consumers else set()
for k in sorted(KINDS - all_consumed):
    problem("k8s", f"no worker Deployment consumes `{k}` jobs (a run would wait for them forever)")

for name, (f, ta) in by_kind.get("TriggerAuthentication", {}).items():
    for ref in ta["spec"].get("secretTargetRef", []):
        keys = data_keys("Secret", ref["name"])
        if keys is None or ref["key"] not in keys:
            problem(f, f"TriggerAuthentication {name} reads key {ref['key']} of Secret {ref['name']}, which is not defined")

scaled = set()
for name, (f, so) in by_kind.get("ScaledObject", {}).items():
    spec = so["spec"]
    target = spec["scaleTargetRef"]["name"]
    scaled.add(target)
    if target not in consumers:
        problem(f, f"ScaledObject {name} scales {target}, which is no worker Deployment here")
        continue
    kinds, container = consumers[target]
    if spec.get("minReplicaCount", 0) > spec.get("maxReplicaCount", 100):
        problem(f, f"ScaledObject {name}: minReplicaCount > maxReplicaCount")
    for t in spec["triggers"]:
        if t["type"] != "rabbitmq":
            continue
        md = t["metadata"]
        auth = t.get("authenticationRef", {}).get("name")
        if auth and auth not in by_kind.get("TriggerAuthentication", {}):
            problem(f, f"trigger uses TriggerAuthentication {auth}, which is not defined")
        if md.get("useRegex") == "true":
            rx = re.compile(md["queueName"])
            watched = {k for k in KINDS | {"sleep"} if rx.fullmatch(f"{prefix}.{k}")}
            for extra in (f"{prefix}.{k}.dead" for k in KINDS):
                if rx.fullmatch(extra):
                    problem(f, f"queueName {md['queueName']} also matches the dead-letter queue {extra}")
        else:
            watched = {md["queueName"][len(prefix) + 1:]} if md["queueName"].startswith(prefix + ".") else set()
        if watched != kinds:
            problem(f, f"ScaledObject {name} watches kinds {sorted(watched)} but {target} consumes {sorted(kinds)} (queue prefix `{prefix}`)")
        concurrency = env_value(container, "HARNESS_S_WORKER_CONCURRENCY") or "1"
        if md.get("mode") == "QueueLength" and md.get("value") != concurrency:
            problem(f, f"ScaledObject {name}: value {md.get('value')} jobs per pod, but {target} runs {concurrency} at once")
for name in consumers:
    if name not in scaled:
        problem("k8s", f"worker Deployment {name} has no ScaledObject")

# the run spec: its endpoint is the serve Service, its pool is in the image, and a CUDA
# learner device goes with the CUDA image on the learn consumer
run_cm = by_kind.get("ConfigMap", {}).get("harness-s-run")
if run_cm is None:
    problem("configmap.yaml", "no ConfigMap harness-s-run")
else:
    run = tomllib.loads(run_cm[1]["data"]["run.toml"])
    policy = run.get("policy", {})
    if policy.get("backend") == "openai":
        u = urllib.parse.urlsplit(policy.get("base_url", ""))
        svc = by_kind.get("Service", {}).get(u.hostname or "")
        if svc is None:
            problem("configmap.yaml", f"policy.base_url {policy.get('base_url')}: no Service {u.hostname} here")
        elif u.port not in [p["port"] for p in svc[1]["spec"]["ports"]]:
            problem("configmap.yaml", f"policy.base_url port {u.port} is not a port of Service {u.hostname}")
    pool = run.get("pool", {}).get("dir")
    if pool:
        image_path(pool, "configmap.yaml harness-s-run [pool] dir")
    learn = [n for n, (k, _) in consumers.items() if "learn" in k]
    for n in learn:
        image = consumers[n][1]["image"]
        gpu = "nvidia.com/gpu" in consumers[n][1].get("resources", {}).get("limits", {})
        if policy.get("device") == "cuda" and not (gpu and image.endswith("-cuda")):
            problem(n, f"the run spec's device is cuda, but {n} (learn) has image {image} and {'a' if gpu else 'no'} GPU limit")

# --------------------------------------------------------------------------- compose
compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
compose_consumed = set()
for name, svc in compose["services"].items():
    where = f"compose.yaml service {name}"
    for p in svc.get("ports", []):
        if not str(p).startswith("127.0.0.1:"):
            problem(where, f"port {p} is not bound to 127.0.0.1")
    env = svc.get("environment", {}) or {}
    cmd = svc.get("command") or []
    if env.get("HARNESS_S_SPEC"):
        image_path(env["HARNESS_S_SPEC"], where)
    if cmd[:1] == ["worker"]:
        compose_consumed |= consumed(env.get("HARNESS_S_WORKER_QUEUES"), where)
    if cmd[:1] in (["run"], ["scheduler"], ["worker"]):
        queue_prefix(env.get("HARNESS_S_QUEUE", ""), where)
for k in sorted(KINDS - compose_consumed):
    problem("compose.yaml", f"no worker consumes `{k}` jobs")

for p in problems:
    print(p)
sys.exit(1 if problems else 0)
