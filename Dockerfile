# hvdlike with torch (CPU), OpenSSH and MPICH: one image for every host of a job.
#
#   docker build -t hvdlike .
#   docker run --rm hvdlike hvdlike-run -np 2 python examples/torch_digits.py
#
# Multi-host: see docs/launcher.md ("Docker"). By default a container is a host:
# it runs sshd on port 22 and trusts the public key(s) mounted at
# /keys/authorized_keys (copied with the owner and mode sshd insists on).
FROM python:3.11-slim

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends openssh-server openssh-client iproute2 procps \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /run/sshd /root/.ssh \
    && chmod 700 /root/.ssh \
    && sed -i 's/^#\?PermitRootLogin .*/PermitRootLogin prohibit-password/; s/^#\?PasswordAuthentication .*/PasswordAuthentication no/' /etc/ssh/sshd_config

# torch first and pinned: an unpinned requirement may pull a multi-GB CUDA build.
RUN pip install torch==2.13.0

# MPI for `hvdlike-run --mpi` and mpirun-started jobs: MPICH and mpi4py from wheels.
RUN pip install mpich mpi4py

# Ranks run in the launcher's working directory on every host: keep it the same.
WORKDIR /opt/hvdlike
COPY . /opt/hvdlike
RUN pip install '.[mpi,examples]'
EXPOSE 22
# Default: be a host a launcher can ssh into. Override the command to launch a job.
CMD ["sh", "-c", "if [ -f /keys/authorized_keys ]; then install -m 600 /keys/authorized_keys /root/.ssh/authorized_keys; fi; exec /usr/sbin/sshd -D -e"]
