"""The real-node tier of the test harness: one real Kubernetes node on this machine.

A kubelet and kube-proxy (built by hack/build-k8s.sh at the pinned version), Debian's containerd,
runc and CNI plugins (installed when missing), and CoreDNS (hack/build-coredns.sh) join the
control plane hack/cluster.py starts. Everything pods reach (apiserver, CoreDNS, MinIO) binds the
address of a bridge the harness creates, never an outside address, and pod traffic is kept on that
bridge. Recipe and pitfalls: shared/notes/real-node.md.

    config   pure renderers of every config file (containerd, CNI, kubelet, kube-proxy, Corefile)
    host     host prerequisites, the bridge, iptables, ip_forward, the machine-wide lock, cleanup
    servers  the node's processes (containerd, kubelet, kube-proxy, CoreDNS), images, readiness
    tier     `up_node` / `down_node`, called by hack/cluster.py for `--tier node`

A second node, added on demand to a running one (`up --nodes 2`, tests' `second_node`), in
network, mount and cgroup namespaces of its own:

    second_config  its names, addresses and paths, and pure plans of the commands that wire it
    namespaces     its namespaces, veth link, routes, firewall chain, cgroup root, partition
    second         its processes, `up_second` / `down_second`, and the runtime stop/start knobs

Standard library only, like the rest of hack/.
"""
