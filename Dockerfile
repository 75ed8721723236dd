# parallax image: TensorFlow 2.17.1, Keras 3, Horovod 0.28.1 (gloo) and parallax, the same
# pins as the README's quick start (`make env`, scripts/setup_env.sh), in layers that change
# as rarely as possible:
#   deps     (builder)  compilers + the venv /opt/venv: requirements/base.txt, Horovod built
#                       against it, then setup.cfg's runtime requirements. Only those manifests
#                       are copied, so a source change never rebuilds Horovod.
#   kernels  (builder)  deps + parallax's compiled data path (setup.py, parallax/native/src):
#                       only its sources are copied, so a Python change never rebuilds it
#   runtime  (default)  BASE + wordnet-base + the venv + the source + the kernels, parallax installed
#                       (editable, offline, no compiler) as uid 10001. No g++, no sshd, no test
#                       or benchmark extras.
#   ssh                 runtime + openssh client and server, for `parallax run --hosts` across
#                       containers over ssh (docker build --target ssh); Kubernetes and compose
#                       do not need it.
# Build:  docker build -t parallax .        (or `make image`: podman, a local base, smoke test)
#         docker build --build-arg BASE=my-registry/python:3.11-slim-bookworm -t parallax .
# pip in the build reads the optional build secrets `pipconf` (a pip.conf) and `pipca` (a CA
# bundle it then trusts), e.g. --secret id=pipca,src=/etc/ssl/certs/ca-certificates.crt; they
# are never stored in the image.
# Run:    docker run --rm -p 7000-7002:7000-7002 parallax server --host 0.0.0.0 --port 7000 \
#           --data-port 7001 --data-dir /data
#         docker compose -f deploy/docker-compose.yml up      (2 servers + 2 workers, one host)
#         parallax k8s --name job --image parallax -- python train.py   (Kubernetes manifests)

# Any Debian bookworm image with python3.11 and its venv module (TF 2.17.1 needs 3.10-3.12).
# The deps and runtime stages must use the same one: the venv links to its interpreter.
ARG BASE=python:3.11-slim-bookworm


FROM ${BASE} AS deps
# g++ and make build Horovod (cmake comes from requirements/base.txt)
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ make \
 && apt-get clean && rm -rf /var/lib/apt/lists/*
ENV PIP_CONFIG_FILE=/run/secrets/pipconf PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3.11 -m venv /opt/venv
# the venv first on PATH: Horovod's build looks for cmake there (requirements/base.txt's)
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /opt/parallax

# 1. TensorFlow, Keras, gRPC and the build tools: changes only with requirements/base.txt
COPY requirements/base.txt requirements/base.txt
RUN --mount=type=secret,id=pipconf --mount=type=secret,id=pipca \
    --mount=type=cache,target=/root/.cache/pip \
    if [ -s /run/secrets/pipca ]; then export PIP_CERT=/run/secrets/pipca; fi \
 && /opt/venv/bin/pip install --upgrade pip setuptools wheel \
 && /opt/venv/bin/pip install -r requirements/base.txt

# 2. Horovod, compiled against that TensorFlow with gloo (about 4 minutes on 2 cores); the
#    flags are scripts/setup_env.sh's
RUN --mount=type=secret,id=pipconf --mount=type=secret,id=pipca \
    if [ -s /run/secrets/pipca ]; then export PIP_CERT=/run/secrets/pipca; fi \
 && HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    /opt/venv/bin/pip install --no-build-isolation --no-cache-dir horovod==0.28.1 \
 && /opt/venv/bin/python -c "import horovod.tensorflow as hvd; assert hvd.gloo_built(), 'Horovod was built without gloo'"

# 3. parallax's own runtime requirements (install_requires and the `tf` extra of setup.cfg),
#    constrained to what is installed so that nothing Horovod was built against moves; then
#    the build- and test-only tools of requirements/base.txt leave the venv, and so do
#    TensorFlow's C++ headers (420 MB: only a custom op's build reads them)
COPY setup.cfg pyproject.toml ./
RUN --mount=type=secret,id=pipconf --mount=type=secret,id=pipca \
    --mount=type=cache,target=/root/.cache/pip \
    if [ -s /run/secrets/pipca ]; then export PIP_CERT=/run/secrets/pipca; fi \
 && /opt/venv/bin/python -c "import configparser; c = configparser.ConfigParser(); \
      c.read('setup.cfg'); print(c['options']['install_requires']); \
      print(c['options.extras_require']['tf'])" >/tmp/project.txt \
 && /opt/venv/bin/pip freeze --exclude-editable >/tmp/installed.txt \
 && /opt/venv/bin/pip install -c /tmp/installed.txt -r /tmp/project.txt \
 && /opt/venv/bin/pip uninstall -y cmake grpcio-tools pytest \
 && /opt/venv/bin/pip check \
 && rm -rf /opt/venv/lib/python3*/site-packages/tensorflow/include


FROM deps AS kernels
# parallax.native._kernels: C++ (pybind11 from requirements/base.txt), built in place as
# `make env` builds it; setup.py reads setup.cfg's metadata (the version, the README)
COPY setup.py README.md LICENSE ./
COPY parallax/version.py parallax/version.py
COPY parallax/native/src parallax/native/src
RUN /opt/venv/bin/python setup.py -q build_ext --inplace \
 && ls parallax/native/_kernels*.so


FROM ${BASE} AS runtime-base
# wordnet-base: the corpus of examples/language_model.py (`parallax demo`, compose's worker)
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends wordnet-base \
 && apt-get clean && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --user-group parallax \
 && mkdir -p /data /var/lib/parallax && chown parallax:parallax /data /var/lib/parallax
COPY --from=deps /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
WORKDIR /opt/parallax
# the source, then parallax itself: editable, as `make env` does (`parallax demo` and compose
# run examples/ from here), offline and without dependencies (the venv has them all)
COPY setup.cfg setup.py pyproject.toml README.md LICENSE ./
COPY servers servers
COPY parallax parallax
COPY examples examples
COPY --from=kernels /opt/parallax/parallax/native/ parallax/native/
RUN pip install --no-index --no-deps --no-build-isolation --no-cache-dir \
      --disable-pip-version-check -q -e . \
 && pip check && parallax --version \
 && python -c "from parallax import native; print(native.describe()); assert native.kernels()"
USER 10001
# 7000: parameter server (gRPC); 7001: its data plane (--data-port); 7002: its Prometheus
# metrics (--metrics-port); 7070: Horovod gloo rendezvous of `parallax k8s` worker 0
EXPOSE 7000 7001 7002 7070
VOLUME ["/data"]
# No HEALTHCHECK: one image serves servers and workers, and a check of the server port would
# mark every worker unhealthy; compose gives its servers one (`parallax status`) and
# Kubernetes probes the servers' gRPC health service.
ENTRYPOINT ["parallax"]
CMD ["--help"]


# `parallax run --hosts` runs servers and Horovod workers on other hosts over ssh: the launcher
# needs ssh, every other host sshd (as root: docker run --user 0 --entrypoint sh IMAGE -c
# 'ssh-keygen -A && exec /usr/sbin/sshd -D -e', with /home/parallax/.ssh/authorized_keys
# mounted). Host keys are not baked in: each container makes its own.
FROM runtime-base AS ssh
USER root
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      openssh-client openssh-server \
 && apt-get clean && rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_*_key* \
 && mkdir -p /run/sshd
USER 10001
EXPOSE 22


# the default target (the last stage): the slim runtime
FROM runtime-base AS runtime
