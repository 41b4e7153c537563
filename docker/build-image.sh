#!/usr/bin/env bash
# Build kvgate's image from the repository's Dockerfile where no container registry can be reached.
#
#   docker/build-image.sh [--target gateway|cpu|cuda] [--tag NAME] [--torch-wheel FILE] [--ca-file FILE]
#                         [--work-dir DIR]
#
# With a registry, `docker build --build-arg TARGET=... .` is all it takes. This script is for a machine with
# Debian's mirror and a Python package index but no registry, so the Dockerfile's base image cannot be pulled:
#   1. it makes the base image from Debian's own packages, `debootstrap --variant=minbase bookworm` (what
#      debian:bookworm-slim is made from), imported into podman as localhost/kvgate-base:bookworm (once);
#   2. builds the Dockerfile with podman on that base, unchanged: the builder fetches Debian packages and
#      wheels over the network as it would under `docker build`;
#   3. runs `kvgate --version` in the image and prints its size and the time each step took.
# Options for what a network may lack:
#   --torch-wheel FILE  a torch wheel to install instead of fetching one from PyTorch's CPU index (cpu target),
#                       e.g. where download.pytorch.org is not reachable; it must be a +cpu build for cpu.
#   --ca-file FILE      the CA bundle of a TLS-intercepting proxy between the build and the package index,
#                       mounted into the builder only (PIP_CERT); it does not reach the final image.
# Work files (the root filesystem, logs) go under --work-dir (default /tmp/kvgate-image-build), never into the
# repository. Needs root (debootstrap, rootful podman), podman and debootstrap (apt-get install podman debootstrap).
#
# Environment: DEBIAN_MIRROR (http://deb.debian.org/debian); PODMAN_OPTS / PODMAN_RUN_OPTS: podman's global and
# run/build options, when this host needs other ones than the script finds (see detect_podman_options).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
target=cpu
tag=""
torch_wheel=""
ca_file=""
work=/tmp/kvgate-image-build
suite=bookworm
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
base_image=localhost/kvgate-base:$suite

die() { echo "build-image: $*" >&2; exit 1; }
step() { step_started=$SECONDS; echo "==> $*"; }
done_step() { echo "    ($((SECONDS - step_started)) s)"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --target) target=${2:?--target needs a value}; shift 2 ;;
        --tag) tag=${2:?--tag needs a value}; shift 2 ;;
        --torch-wheel) torch_wheel=${2:?--torch-wheel needs a file}; shift 2 ;;
        --ca-file) ca_file=${2:?--ca-file needs a file}; shift 2 ;;
        --work-dir) work=${2:?--work-dir needs a directory}; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (--help lists them)" ;;
    esac
done
case "$target" in gateway|cpu|cuda) ;; *) die "--target must be gateway, cpu or cuda; got '$target'" ;; esac
if [ -n "$torch_wheel" ]; then
    [ -f "$torch_wheel" ] || die "--torch-wheel $torch_wheel: no such file"
    torch_name=$(basename "$torch_wheel")
    torch_pin=$(echo "$torch_name" | cut -d- -f2)  # torch-2.13.0+cpu-cp311-cp311-...whl -> 2.13.0+cpu
    case "$target:$torch_name" in
        gateway:*) die "--torch-wheel: the gateway target has no torch" ;;
        cpu:torch-*+cpu-*.whl) ;;
        cpu:*) die "--torch-wheel: the cpu target needs a CPU build of torch (torch-X+cpu-...whl), got $torch_name" ;;
        cuda:torch-*+cpu-*.whl) die "--torch-wheel: the cuda target needs a CUDA build of torch, got $torch_name" ;;
        *:torch-*.whl) ;;
        *) die "--torch-wheel: $torch_name is not a torch wheel" ;;
    esac
fi
[ -z "$ca_file" ] || [ -f "$ca_file" ] || die "--ca-file $ca_file: no such file"
command -v podman >/dev/null || die "podman is not installed (Debian: apt-get install -y podman)"

version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$repo/kvgate/__init__.py")
[ -n "$version" ] || die "cannot read __version__ from $repo/kvgate/__init__.py"
tag=${tag:-localhost/kvgate:$version-$target}
revision=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ -n "$(git -C "$repo" status --porcelain 2>/dev/null)" ]; then revision="$revision-dirty"; fi
mkdir -p "$work"
total_started=$SECONDS

# podman's defaults fail on some hosts (this project's CI VMs among them): crun refuses a cgroup v1 host
# whose cgroup2 hierarchy also holds a controller ("cgroups in hybrid mode not supported"), and without
# CAP_SYS_RESOURCE rootful podman's default container limits (nofile 1048576, nproc 4194304) cannot be set
# ("setrlimit RLIMIT_NOFILE: Operation not permitted"). Then: runc, and limits no higher than podman's own
# process has (this shell's nofile; nproc at most 32768, which rootful podman sets for itself).
detect_podman_options() {
    if [ -n "${PODMAN_OPTS+set}${PODMAN_RUN_OPTS+set}" ]; then
        read -r -a podman_opts <<<"${PODMAN_OPTS:-}"
        read -r -a run_opts <<<"${PODMAN_RUN_OPTS:-}"
        return
    fi
    podman_opts=(); run_opts=()
    if podman run --rm "$base_image" true >/dev/null 2>&1; then return; fi
    command -v runc >/dev/null \
        || die "podman cannot run a container here with its defaults, and runc (the fallback) is not" \
               "installed: apt-get install -y runc"
    local nofile nproc error
    nofile=$(ulimit -Hn)
    nproc=$(ulimit -Hu)
    if [ "$nofile" = unlimited ]; then nofile=1048576; fi
    if [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; then nproc=32768; fi
    podman_opts=(--runtime runc)
    run_opts=(--ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc")
    if ! error=$(podman "${podman_opts[@]}" run --rm "${run_opts[@]}" "$base_image" true 2>&1); then
        die "podman cannot run a container here, with or without ${podman_opts[*]} ${run_opts[*]}: $error"
    fi
    echo "    podman's defaults fail here; using ${podman_opts[*]} ${run_opts[*]}"
}

# 1. The base image, made from Debian's packages.
if ! podman image exists "$base_image"; then
    step "making $base_image with debootstrap from $mirror"
    command -v debootstrap >/dev/null || die "debootstrap is not installed (Debian: apt-get install -y debootstrap)"
    [ "$(id -u)" -eq 0 ] || die "debootstrap needs root"
    rootfs="$work/rootfs-$suite"
    rm -rf "$rootfs"
    debootstrap --variant=minbase "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
        || die "debootstrap failed; the end of $work/debootstrap.log: $(tail -5 "$work/debootstrap.log")"
    # Slim it as Debian's official -slim images are: no downloaded packages or package lists (the Dockerfile
    # runs apt-get update itself), and dpkg leaves out documentation, man pages and translations (licences stay),
    # for what it installs later too.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/*
    printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
        'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' 'path-exclude /usr/share/groff/*' \
        'path-exclude /usr/share/lintian/*' 'path-exclude /usr/share/locale/*' \
        >"$rootfs/etc/dpkg/dpkg.cfg.d/kvgate-slim"
    find "$rootfs/usr/share/doc" -type f ! -name copyright -delete
    find "$rootfs/usr/share/doc" -depth -type d -empty -delete
    rm -rf "$rootfs"/usr/share/{man,info,groff,lintian,locale}/*
    tar -C "$rootfs" --numeric-owner -c . | podman import --change 'CMD ["/bin/bash"]' - "$base_image" >/dev/null
    rm -rf "$rootfs"
    done_step
fi
detect_podman_options

# 2. The image: the Dockerfile as it is, on the local base, with what this network needs mounted for the builder.
build_args=(--build-arg "BASE_IMAGE=$base_image" --build-arg "TARGET=$target" --build-arg "VERSION=$version"
            --build-arg "REVISION=$revision" --build-arg "CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)")
if [ -n "$torch_wheel" ]; then
    # The wheel is the only torch of that version anywhere (a local version label: +cpu), so pip takes it
    # from find-links; torch's own dependencies come from PyPI, as with PyTorch's index.
    build_args+=(--volume "$(realpath "$torch_wheel"):/run/kvgate-build/wheels/$torch_name:ro"
                 --build-arg PIP_FIND_LINKS=/run/kvgate-build/wheels --build-arg "TORCH_VERSION=$torch_pin"
                 --build-arg TORCH_CPU_INDEX_URL=https://pypi.org/simple)
fi
if [ -n "$ca_file" ]; then
    build_args+=(--volume "$(realpath "$ca_file"):/run/kvgate-build/ca.pem:ro"
                 --build-arg PIP_CERT=/run/kvgate-build/ca.pem)
fi
log="$work/build-$target.log"
step "building $tag (TARGET=$target; podman's output goes to $log)"
podman "${podman_opts[@]}" build "${run_opts[@]}" "${build_args[@]}" -t "$tag" "$repo" >"$log" 2>&1 \
    || die "podman build failed; the end of $log:
$(tail -15 "$log")"
grep -E '^(target |kvgate [0-9])' "$log" | sed 's/^/    builder: /'
done_step

# 3. Does it run?
step "running $tag"
podman "${podman_opts[@]}" run --rm "${run_opts[@]}" "$tag" --version
size_bytes=$(podman image inspect --format '{{.Size}}' "$tag")
echo "    $tag: $((size_bytes / 1000000)) MB; $((SECONDS - total_started)) s in all"
echo "    try: podman ${podman_opts[*]} run --rm ${run_opts[*]} $tag router --help"
done_step
