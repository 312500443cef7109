#!/usr/bin/env bash
# The main job, end to end on the built-in default model (CPU): see README.
source "$(dirname "$0")/env.sh"
pipesim demo "$@"
