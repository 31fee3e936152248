#!/bin/sh
# Example: bake the jobagent package into a stock cloud image, so worker VMs
# boot without downloading it (jobagent-user-data.yaml then skips the
# install). The package does not enable the agent, so the baked image runs
# no agent until cloud-init has written /etc/vq/identity.toml and enabled it.
#
# Needs libguestfs-tools (virt-customize) and the OpenStack CLI with
# credentials (OS_CLOUD). Usage:
#   bake-image.sh target/packages/jobagent_0.1.0-1_amd64.deb [image-name]
set -eu
DEB=${1:?usage: bake-image.sh jobagent_VERSION_amd64.deb [image-name]}
NAME=${2:-vq-worker-debian12}
BASE_URL=${BASE_URL:-https://cloud.debian.org/images/cloud/bookworm/latest/debian-12-genericcloud-amd64.qcow2}

curl -fL -o base.qcow2 "$BASE_URL"
cp base.qcow2 "$NAME.qcow2"
virt-customize -a "$NAME.qcow2" \
    --copy-in "$DEB:/tmp" \
    --run-command "dpkg -i /tmp/$(basename "$DEB") && rm -f /tmp/$(basename "$DEB")" \
    --run-command "/usr/sbin/jobagent --version" \
    --run-command "cloud-init clean --logs --machine-id"
openstack image create --disk-format qcow2 --container-format bare \
    --file "$NAME.qcow2" --property vq_jobagent="$(basename "$DEB")" "$NAME"
