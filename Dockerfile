# parallax image: TensorFlow 2.17.1, Horovod 0.28.1 (gloo) and parallax, installed by the same
# script as the README's quick start (`make env` runs scripts/setup_env.sh). Entry point: the
# `parallax` CLI; runs as the non-root user `parallax` (uid 10001).
#   docker build -t parallax .
#   docker run --rm -p 7000-7001:7000-7001 parallax server --host 0.0.0.0 --port 7000 \
#     --data-port 7001 --data-dir /data          (7001: the data plane, PullMany/PushMany)
#   docker compose -f deploy/docker-compose.yml up      (2 servers + 2 workers, one host)
#   parallax k8s --name job --image parallax -- python train.py   (Kubernetes manifests)
FROM python:3.11-slim-bookworm

# g++ and make build Horovod; wordnet-base is the corpus of examples/language_model.py
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ make git wordnet-base \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/parallax
COPY . .
ENV PARALLAX_VENV=/opt/venv PYTHON=python3.11
RUN make env && rm -rf /root/.cache/pip \
 && useradd --create-home --uid 10001 parallax \
 && mkdir -p /data && chown parallax /data
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
USER 10001
# 7000: parameter server (gRPC); 7001: its data plane (--data-port 7001); 7070: Horovod gloo
# rendezvous of `parallax k8s` worker 0
EXPOSE 7000 7001 7070
VOLUME ["/data"]
ENTRYPOINT ["parallax"]
CMD ["--help"]
