#!/usr/bin/env bash
# Two "hosts" on this machine for the multi-host test: network namespaces ${PREFIX}a (10.77.0.1)
# and ${PREFIX}b (10.77.0.2) joined by a veth pair (named eth0 in both, so that Horovod finds a
# common interface), each running its own sshd on port 22 that accepts root with a key made
# for this run. Needs root, iproute2 and openssh-server (scripts/setup_env.sh installs it).
#
#   scripts/netns_cluster.sh up DIR     # keys, configs, pid files under DIR (made if missing)
#   scripts/netns_cluster.sh down DIR   # stops everything in the namespaces, deletes them
#
# After `up`, DIR/bin/ssh is ssh with DIR/ssh_config (the key, no host-key checks, nothing
# written to ~/.ssh): put DIR/bin first on PATH for the launcher and horovodrun.
set -euo pipefail
cmd="${1:?usage: $0 up|down DIR}"
dir="${2:?usage: $0 up|down DIR}"
prefix="${NETNS_PREFIX:-pxt}"
a="${prefix}a" b="${prefix}b"
sshd="$(command -v sshd || echo /usr/sbin/sshd)"

down() {
  for ns in "$a" "$b"; do
    if ip netns list | grep -qw "$ns"; then
      for pid in $(ip netns pids "$ns"); do kill -TERM "$pid" 2>/dev/null || true; done
      for _ in $(seq 50); do [ -z "$(ip netns pids "$ns")" ] && break; sleep 0.1; done
      for pid in $(ip netns pids "$ns"); do kill -KILL "$pid" 2>/dev/null || true; done
      for _ in $(seq 50); do ip netns del "$ns" 2>/dev/null && break; sleep 0.1; done
      if ip netns list | grep -qw "$ns"; then echo "could not delete namespace $ns" >&2; exit 1; fi
    fi
    rm -rf "/etc/netns/$ns"
  done
  ip link del "${prefix}-va" 2>/dev/null || true
}

if [ "$cmd" = down ]; then down; exit 0; fi
[ "$cmd" = up ] || { echo "usage: $0 up|down DIR" >&2; exit 2; }
[ -x "$sshd" ] || { echo "sshd not found: apt-get install openssh-server (scripts/setup_env.sh)" >&2; exit 1; }
down
mkdir -p "$dir/bin" /run/sshd
chmod 700 "$dir"
rm -f "$dir/host_key" "$dir/host_key.pub" "$dir/id_ed25519" "$dir/id_ed25519.pub"
ssh-keygen -q -t ed25519 -N '' -f "$dir/host_key"
ssh-keygen -q -t ed25519 -N '' -f "$dir/id_ed25519"
cp "$dir/id_ed25519.pub" "$dir/authorized_keys"
cat >"$dir/sshd_config" <<CONF
Port 22
HostKey $dir/host_key
AuthorizedKeysFile $dir/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
AcceptEnv *
MaxStartups 100
CONF
cat >"$dir/ssh_config" <<CONF
Host *
  User root
  IdentityFile $dir/id_ed25519
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  GlobalKnownHostsFile /dev/null
  LogLevel ERROR
  BatchMode yes
  ConnectTimeout 10
CONF
printf '#!/bin/sh\nexec %s -F %s "$@"\n' "$(command -v ssh)" "$dir/ssh_config" >"$dir/bin/ssh"
chmod +x "$dir/bin/ssh"

ip netns add "$a"
ip netns add "$b"
# Each "host" resolves this machine's hostname to its own address (ip netns exec bind-mounts
# /etc/netns/NS/hosts over /etc/hosts): Horovod's gloo advertises the address the hostname
# resolves to, and the shared /etc/hosts maps it to 127.0.0.1, unreachable from the peer.
for pair in "$a 10.77.0.1" "$b 10.77.0.2"; do
  set -- $pair
  mkdir -p "/etc/netns/$1"
  printf '127.0.0.1 localhost\n%s %s\n' "$2" "$(hostname)" >"/etc/netns/$1/hosts"
done
ip link add "${prefix}-va" type veth peer name "${prefix}-vb"
ip link set "${prefix}-va" netns "$a"
ip link set "${prefix}-vb" netns "$b"
ip -n "$a" link set "${prefix}-va" name eth0
ip -n "$b" link set "${prefix}-vb" name eth0
ip -n "$a" addr add 10.77.0.1/24 dev eth0
ip -n "$b" addr add 10.77.0.2/24 dev eth0
for ns in "$a" "$b"; do
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
done
ip netns exec "$a" "$sshd" -f "$dir/sshd_config" -o ListenAddress=10.77.0.1 -o PidFile="$dir/sshd-a.pid"
ip netns exec "$b" "$sshd" -f "$dir/sshd_config" -o ListenAddress=10.77.0.2 -o PidFile="$dir/sshd-b.pid"
for ip in 10.77.0.1 10.77.0.2; do
  for _ in $(seq 50); do
    ip netns exec "$a" "$dir/bin/ssh" "$ip" true 2>/dev/null && continue 2
    sleep 0.1
  done
  echo "sshd on $ip does not answer" >&2
  exit 1
done
echo "netns cluster up: $a=10.77.0.1 $b=10.77.0.2 (ssh: $dir/bin/ssh)"
