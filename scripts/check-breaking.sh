#!/usr/bin/env bash
# `buf breaking` of the working tree's protos against where this branch left main, from git
# (offline): the merge base of HEAD and main. On main that is HEAD itself, so it guards
# uncommitted changes; on a branch it guards the branch's own changes, however far main has
# moved since. A clone without a main branch has nothing to compare with and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
buf="${BUF:-.venv/bin/buf}"
if ! git show-ref --verify --quiet refs/heads/main; then
    echo "buf breaking: skipped, this clone has no main branch to compare with"
    exit 0
fi
git_dir="$(git rev-parse --path-format=absolute --git-common-dir)"
base="$(git merge-base HEAD main)"
except=""
# The per-language options (go_package, java_package, ...) came after the first protos: their
# arrival breaks nobody. Once the base carries them, every FILE rule applies to them.
if ! git show "$base:protos/rollout/agent/v1/agent.proto" | grep -q '^option go_package'; then
    except='"FILE_SAME_GO_PACKAGE", "FILE_SAME_JAVA_PACKAGE", "FILE_SAME_JAVA_MULTIPLE_FILES",
        "FILE_SAME_CSHARP_NAMESPACE"'
fi
# Both sides are our own module only: the vendored third_party/protos are not ours to keep.
config='{"version": "v2", "modules": [{"path": "protos"}],
    "breaking": {"use": ["FILE"], "except": ['"$except"']}}'
"$buf" breaking --config "$config" --against "${git_dir}#ref=${base}" --against-config "$config"
echo "buf breaking: protos/ has no breaking change against ${base:0:12} (main)"
