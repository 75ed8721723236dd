# parallax image: TensorFlow 2.17.1, Horovod 0.28.1 (gloo) and parallax, installed by the same
# script as the README's quick start. Entry point: the `parallax` CLI.
#   docker build -t parallax .
#   docker run --rm -p 5000:5000 parallax server --host 0.0.0.0 --port 5000 --data-dir /data
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ make git \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/parallax
COPY . .
ENV PARALLAX_VENV=/opt/venv
RUN make env && rm -rf /root/.cache/pip
ENV PATH=/opt/venv/bin:$PATH
VOLUME ["/data"]
ENTRYPOINT ["parallax"]
CMD ["--help"]
