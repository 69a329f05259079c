#!/bin/bash
# iproute2 (ip, tc) on a machine that lacks it and has no package registry: unpack Debian packages
# fetched elsewhere and put wrappers first on PATH, so shared/links.py can build shaped links there.
#
#   here:   mkdir DEBS && cd DEBS && apt-get download iproute2 libbpf1 libelf1 libmnl0 libcap2 \
#             libxtables12 libtirpc3 libdb5.3 libbsd0 libmd0          (2.4 MB)
#   there:  source dev/iproute2_from_debs.sh DEBS    (then: ip netns ..., tc qdisc ..., make poc-16 ...)
#
# The wrappers give only ip and tc the unpacked libraries: `ip netns exec NS cmd` runs cmd with the
# caller's own LD_LIBRARY_PATH, so a Python started in a namespace loads the machine's libraries.
debs=$(cd "${1:?usage: source dev/iproute2_from_debs.sh DEB_FOLDER}" && pwd)
root=${IPROUTE2_ROOT:-/tmp/iproute2}
mkdir -p "$root/wrap"
for deb in "$debs"/*.deb; do dpkg -x "$deb" "$root"; done
libs="$root/lib/x86_64-linux-gnu:$root/usr/lib/x86_64-linux-gnu"
cat > "$root/wrap/ip" <<EOF
#!/bin/bash
caller_libs="\${LD_LIBRARY_PATH-}"
if [ "\$1" = netns ] && [ "\$2" = exec ] && [ \$# -ge 4 ]; then
  ns=\$3; shift 3
  LD_LIBRARY_PATH="$libs" exec "$root/bin/ip" netns exec "\$ns" env LD_LIBRARY_PATH="\$caller_libs" "\$@"
fi
LD_LIBRARY_PATH="$libs" exec "$root/bin/ip" "\$@"
EOF
cat > "$root/wrap/tc" <<EOF
#!/bin/bash
LD_LIBRARY_PATH="$libs" exec "$root/sbin/tc" "\$@"
EOF
chmod +x "$root/wrap/ip" "$root/wrap/tc"
export PATH="$root/wrap:$PATH"
ip -V && tc -V
