"""SQL tables of the store: the log index, trajectory tail state, samples.

This module is Alembic's target metadata; the migrations under
``migrations/versions`` create exactly these tables (and the inspection
views). Only small columns live here: token-level data is in payload
segments (``trajstore.payload``) that rows point at by (segment, row).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    JSON,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    text,
)

metadata = MetaData()

# One row, id = 1. Appenders take positions from it with
# UPDATE ... RETURNING inside their transaction; the row lock this takes
# makes commits happen in position order (see docs/log.md).
log_head = Table(
    "log_head",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("position", BigInteger, nullable=False),
)

# Tail state of each trajectory: everything admission needs to validate the
# next event without reading payload (the fold's FoldTail is part of it). ``revision`` is bumped by every event
# and guards concurrent writers (optimistic concurrency).
trajectories = Table(
    "trajectories",
    metadata,
    Column("trajectory_id", String(255), primary_key=True),
    Column("group_id", String(255), nullable=True, index=True),
    Column("num_experts", Integer, nullable=True),
    Column("metadata", JSON, nullable=False),
    Column("status", String(16), nullable=False),  # running | completed | truncated | aborted | failed
    Column("revision", Integer, nullable=False),
    Column("last_seq", Integer, nullable=False),
    Column("reward_mode", String(8), nullable=True),  # scalar | token
    Column("route_layers", Integer, nullable=True),
    Column("route_topk", Integer, nullable=True),
    Column("seq_len", BigInteger, nullable=False),
    Column("seq_hash", LargeBinary(16), nullable=False),
    Column("route_len", BigInteger, nullable=False),
    Column("reward", Float, nullable=True),  # last trajectory-level reward event
    Column("started_position", BigInteger, nullable=False),
    Column("finished_position", BigInteger, nullable=True, index=True),
    Column("created_at", Float, nullable=False),  # unix seconds
    Column("updated_at", Float, nullable=False),
    # migration 0006: the fold's tail (trajstore.fold.FoldTail) also counts the samples
    # started so far; the current sample is num_samples - 1.
    Column("num_samples", Integer, nullable=False, server_default="0"),
    # migration 0015: when ``trajstore archive`` moved the trajectory's events out of the
    # index into a Parquet archive (docs/deploy.md, "Index growth"); NULL while they are in it
    Column("archived_at", Float, nullable=True),
)

# migration 0015: the finished trajectories ``trajstore archive`` may still take, without the archived ones
Index("ix_trajectories_unarchived", trajectories.c.finished_position,
      postgresql_where=trajectories.c.archived_at.is_(None), sqlite_where=trajectories.c.archived_at.is_(None))

# The append-only log index: one row per stored event, in position order.
events = Table(
    "events",
    metadata,
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("trajectory_id", String(255), nullable=False),
    Column("type", String(24), nullable=False),
    Column("seq", Integer, nullable=True),
    Column("event_id", String(255), nullable=True),
    # event_id when given, else (type, trajectory, seq); NULL for reward events
    # without event_id (each one replaces the previous reward).
    Column("identity", String(600), nullable=True, unique=True),
    Column("content_hash", LargeBinary(16), nullable=False),
    Column("model_version", Integer, nullable=True),  # the last output token's version
    Column("prompt_len", Integer, nullable=True),
    Column("prefix_len", Integer, nullable=True),  # prompt tokens reused from the trajectory's sequence
    Column("output_len", Integer, nullable=True),
    Column("num_loss_tokens", Integer, nullable=True),
    Column("routes_start", Integer, nullable=True),  # absolute position of the first stored route row
    Column("num_route_rows_sent", Integer, nullable=True),
    Column("num_route_rows", Integer, nullable=True),  # rows stored (new positions only)
    Column("routes_dtype", String(8), nullable=True),
    Column("reward", Float, nullable=True),
    Column("has_token_rewards", Boolean, nullable=True),
    Column("finish_reason", String(64), nullable=True),
    Column("status", String(16), nullable=True),
    Column("segment", String(255), nullable=True),
    Column("segment_row", Integer, nullable=True),
    Column("created_at", Float, nullable=False),
    # migration 0004: docs/reference.md "Versions" and generation metadata
    Column("min_model_version", Integer, nullable=True),  # the first output token's version
    # Only for a call whose tokens span several versions (else NULL): one object per
    # run of equal versions, {"model_version", "num_tokens", "num_loss_tokens"}, in token order.
    Column("version_spans", JSON(none_as_null=True), nullable=True),
    Column("metadata", JSON(none_as_null=True), nullable=True),  # a generation's free-form metadata
    # migration 0006: the outcome of the fold's step (trajstore.fold.FoldStep) for a generation
    Column("sample_index", Integer, nullable=True),  # the sample the call folds into
    Column("is_merged", Boolean, nullable=True),  # the prompt continued the previous call's sequence
    # migration 0007: NULL while (segment, segment_row) is the event's own row in a log
    # segment; 'samples' once the materializer re-pointed it to the sample row it folded
    # into (the event's slices of that row follow from prefix_len, prompt_len,
    # output_len, routes_start and num_route_rows; docs/log.md "One copy").
    Column("segment_kind", String(8), nullable=True),
    # migration 0009: a generation's weight_versions spans exactly as sent
    # ([{"version": label, "start", "end"}], labels verbatim); NULL when it sent none.
    Column("weight_versions", JSON(none_as_null=True), nullable=True),
    # migration 0009: logprobs at or below -9999.0 (the engine's placeholder for none,
    # stored as missing); NULL when the call sent no logprobs or was appended before 0009
    Column("num_placeholder_logprobs", Integer, nullable=True),
    # migration 0009: route drift (docs/reference.md R3 health). Rows the call sent for positions its
    # sample had already recorded (the fold ignores them), and how many of those differ
    # from the recorded rows in any entry. NULL without routes; drifted NULL when not
    # measured (rows appended before 0009: resent was backfilled, drift cannot be).
    Column("route_rows_resent", Integer, nullable=True),
    Column("route_rows_drifted", Integer, nullable=True),
    Index("ix_events_trajectory_seq", "trajectory_id", "position"),
    # the materializer's poll: finished events after a position, in order
    Index("ix_events_type_position", "type", "position"),
    # which events a segment still holds (retiring, compaction; migration 0007)
    Index("ix_events_segment", "segment"),
)

# Payload segment files referenced by events or samples; a file in the
# payload directory without a row here is garbage from a crashed append or
# compaction. ``retired_at`` (migration 0007): when no event named the (log)
# segment any more; ``trajstore gc`` deletes it once that is older than its grace.
segments = Table(
    "segments",
    metadata,
    Column("name", String(255), primary_key=True),
    Column("kind", String(8), nullable=False),  # events | samples
    Column("num_rows", Integer, nullable=False),
    Column("num_bytes", BigInteger, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("retired_at", Float, nullable=True),
    # the GC's steady path: retired segments only (migration 0015)
    Index("ix_segments_retired", "retired_at", sqlite_where=text("retired_at IS NOT NULL"),
          postgresql_where=text("retired_at IS NOT NULL")),
)

# Readers' leases (migration 0015): a live reader may still open any segment
# retired after its ``held_since``; the payload GC deletes only segments retired
# before every unexpired lease's (``trajstore._upkeep.gc``). Times are the database's.
reader_leases = Table(
    "reader_leases",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("holder", String(255), nullable=False),
    Column("held_since", Float, nullable=False),
    Column("renewed_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
)

# Materialized samples: order key (finished_position, sample_index).
samples = Table(
    "samples",
    metadata,
    Column("trajectory_id", String(255), primary_key=True),
    Column("sample_index", Integer, primary_key=True),
    Column("finished_position", BigInteger, nullable=False),
    Column("group_id", String(255), nullable=True, index=True),
    Column("status", String(16), nullable=False),
    Column("is_last_step", Boolean, nullable=False),
    Column("prompt_len", Integer, nullable=False),
    Column("response_len", Integer, nullable=False),
    Column("num_loss_tokens", Integer, nullable=False),
    Column("num_merged_calls", Integer, nullable=False),
    Column("reward", Float, nullable=True),
    Column("min_model_version", Integer, nullable=False),
    Column("max_model_version", Integer, nullable=False),
    Column("num_route_rows", Integer, nullable=True),  # captured (unmasked) rows; NULL without routes
    Column("segment", String(255), nullable=False),
    Column("segment_row", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("finish_reason", String(64), nullable=True),  # migration 0004: the last merged call's own
    Index("ix_samples_order", "finished_position", "sample_index", unique=True),
)

# One row per materializer shard: how far in the log it has folded.
materializer_checkpoints = Table(
    "materializer_checkpoints",
    metadata,
    Column("shard", String(64), primary_key=True),
    Column("position", BigInteger, nullable=False),
    Column("num_steps_before", BigInteger, nullable=False),
    Column("num_samples_after", BigInteger, nullable=False),
    Column("prefix_mismatch_count", BigInteger, nullable=False),
    Column("updated_at", Float, nullable=False),
)

# Finished trajectories the materializer could not fold (missing or unreadable
# payload, contradictory index rows, a fold refusal, a value that does not fit
# the sample columns): recorded with the reason in the transaction that moves
# the shard's checkpoint past them, and skipped (docs/materializer.md).
unfoldable_trajectories = Table(
    "unfoldable_trajectories",
    metadata,
    Column("trajectory_id", String(255), primary_key=True),
    Column("finished_position", BigInteger, nullable=False, index=True),
    Column("shard", String(64), nullable=False),
    Column("error", String(64), nullable=False),  # exception class, e.g. CorruptStoreError, OverflowError
    Column("rule", String(64), nullable=True),  # ValidationError.rule when the fold refused it
    Column("message", String(1000), nullable=False),
    Column("created_at", Float, nullable=False),
    # migration 0012: 'data' (a data rule: recorded for good) or 'internal_error' (a bug in
    # the fold, not the data: folded again by the next run, docs/materializer.md)
    Column("kind", String(16), nullable=False, server_default="data"),
)

# migration 0009: the store's label map (docs/reference.md "Versions"), filled by version_label
# events: an engine's weight-version label -> a model version. A label is mapped
# once (a different version for it is a conflict); ``position`` is the
# version_label event's.
version_labels = Table(
    "version_labels",
    metadata,
    Column("label", String(255), primary_key=True),
    Column("model_version", Integer, nullable=False),
    Column("position", BigInteger, nullable=False),
    Column("created_at", Float, nullable=False),
)

# migration 0009: the weight_versions labels of a generation that the label map
# did not hold when it was appended (one row per event and label; never updated).
# The event's trajectory is held back from materialization until every such label
# is mapped (docs/reference.md, "Versions"); the views name the label.
unresolved_labels = Table(
    "unresolved_labels",
    metadata,
    Column("event_position", BigInteger, primary_key=True),
    Column("label", String(255), primary_key=True),
    Column("trajectory_id", String(255), nullable=False, index=True),
    Index("ix_unresolved_labels_label", "label"),
)

# Settings of the store every process reads when it opens it (migration 0010):
# ``payload_location``, where the payload files live, recorded when the store is
# created (docs/deploy.md, "Where the payload lives").
store_settings = Table(
    "store_settings",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", String(2000), nullable=False),
    Column("updated_at", Float, nullable=False),
)

# migration 0011: named projections (docs/projections.md). A projection re-folds the
# log under another fold policy (trajstore.fold.FoldPolicy) into samples of its own,
# beside the default ones: its rows never touch ``samples``, the checkpoints or the
# events' payload locators. ``token`` names its sample segments (a projection dropped
# and created again never reuses a file name).
projections = Table(
    "projections",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("merge", String(16), nullable=False),
    Column("observation", String(16), nullable=False),
    Column("routes", String(16), nullable=False),
    Column("token", String(32), nullable=False, unique=True),
    Column("created_at", Float, nullable=False),
)

# A projection's samples: the columns of ``samples`` plus the projection's name.
projection_samples = Table(
    "projection_samples",
    metadata,
    Column("projection", String(64), primary_key=True),
    *[Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable)
      for c in samples.columns],
    Index("ix_projection_samples_order", "projection", "finished_position", "sample_index", unique=True),
)

# A projection's materializer checkpoints (one per shard), like materializer_checkpoints.
projection_checkpoints = Table(
    "projection_checkpoints",
    metadata,
    Column("projection", String(64), primary_key=True),
    *[Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable)
      for c in materializer_checkpoints.columns],
)

# Trajectories a projection could not fold (the same reasons as unfoldable_trajectories,
# plus a policy the stored facts cannot serve: rule ``routes_not_stored``).
projection_unfoldable = Table(
    "projection_unfoldable",
    metadata,
    Column("projection", String(64), primary_key=True),
    *[Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable,
             server_default=None if c.server_default is None else c.server_default.arg)
      for c in unfoldable_trajectories.columns],
)

# migration 0013: training lineage (docs/reference.md "Training lineage"; docs/reference.md). Filled by
# the train_step and sample_annotation events in the transaction that appends them
# (``position`` is the event's); never updated. The views ``train_steps``,
# ``sample_consumption``, ``train_rollout_mismatch`` and
# ``train_rollout_mismatch_by_version`` read them, the highest attempt standing.

# One row per train_step event: (run, step, rank, attempt).
lineage_steps = Table(
    "lineage_steps",
    metadata,
    Column("run", String(255), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("rank", Integer, primary_key=True),
    Column("attempt", Integer, primary_key=True),
    Column("world_size", Integer, nullable=False),
    Column("policy_version", Integer, nullable=False),
    Column("projection", String(64), nullable=True),  # NULL: the default samples
    Column("num_samples", Integer, nullable=False),
    Column("num_response_tokens", BigInteger, nullable=False),
    Column("metrics", Text, nullable=False),  # a JSON object as text
    Column("identity", String(600), nullable=False),  # the event's (events.identity)
    Column("position", BigInteger, nullable=False),
    Column("created_at", Float, nullable=False),
    # migration 0024: the projection's identity (projections.token) when the step was
    # written; NULL: the default samples (or a step recorded before 0024)
    Column("projection_token", String(32), nullable=True),
)

# The samples of each train_step, with what the sample row said when the step was
# appended (its response length and version range: staleness at training time).
lineage_step_samples = Table(
    "lineage_step_samples",
    metadata,
    Column("run", String(255), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("rank", Integer, primary_key=True),
    Column("attempt", Integer, primary_key=True),
    Column("trajectory_id", String(255), primary_key=True),
    Column("sample_index", Integer, primary_key=True),
    Column("ordinal", Integer, nullable=False),  # its place in the step's samples list
    Column("response_len", Integer, nullable=False),
    Column("min_model_version", Integer, nullable=False),
    Column("max_model_version", Integer, nullable=False),
    # PostgreSQL only (migration 0021): on SQLite a step's samples would scatter over its leaf
    # pages, each written whole to the WAL by the trainer's record
    Index("ix_lineage_step_samples_sample", "trajectory_id", "sample_index").ddl_if(dialect="postgresql"),
)

# One row per sample_annotation event. Its arrays live in a payload segment
# (``segment``, ``segment_row``); the mismatch with the rollout logprobs is
# aggregated at admission (over the tokens where loss_mask and logprobs_mask are
# both true, r = trainer logprob - rollout logprob, k3 = exp(r) - 1 - r).
lineage_annotations = Table(
    "lineage_annotations",
    metadata,
    Column("run", String(255), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("attempt", Integer, primary_key=True),
    Column("trajectory_id", String(255), primary_key=True),
    Column("sample_index", Integer, primary_key=True),
    Column("projection", String(64), nullable=True),
    Column("num_tokens", Integer, nullable=True),  # entries of its per-token arrays (NULL: none)
    Column("has_trainer_logprobs", Boolean, nullable=False),
    Column("has_advantages", Boolean, nullable=False),  # per-token advantages in the payload
    Column("advantage", Float, nullable=True),  # advantages sent as one number
    Column("has_entropy", Boolean, nullable=False),
    Column("metrics", Text, nullable=False),
    Column("tokens_compared", Integer, nullable=True),  # NULL without trainer_logprobs
    Column("k3_sum", Float, nullable=True),
    Column("abs_log_ratio_sum", Float, nullable=True),
    Column("log_ratio_max_abs", Float, nullable=True),
    Column("identity", String(600), nullable=False),
    Column("position", BigInteger, nullable=False),
    Column("segment", String(255), nullable=True),
    Column("segment_row", Integer, nullable=True),
    Column("created_at", Float, nullable=False),
    Index("ix_lineage_annotations_sample", "trajectory_id", "sample_index"),
)

# The same aggregates per model version of the compared tokens (their own
# token_model_versions), one row per annotation and version.
lineage_annotation_versions = Table(
    "lineage_annotation_versions",
    metadata,
    Column("run", String(255), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("attempt", Integer, primary_key=True),
    Column("trajectory_id", String(255), primary_key=True),
    Column("sample_index", Integer, primary_key=True),
    Column("model_version", Integer, primary_key=True),
    Column("tokens_compared", Integer, nullable=False),
    Column("k3_sum", Float, nullable=False),
    Column("abs_log_ratio_sum", Float, nullable=False),
)

# migration 0015: the run view's aggregates (docs/report.md "Aggregates"), counted where the
# data is already decoded, in the transaction that stores it: the append's for the
# generation events' columns (output lengths, route drift), the materializer's commit
# for the default samples' token columns (expert load, rollout logprobs). Each key of
# those two is added to (INSERT ... ON CONFLICT DO UPDATE), never rewritten, except by
# ``trajstore report --rebuild-aggregates``, which recounts them from the log and samples.

# Decode routes of the default samples' generated tokens per layer and expert, ONE row per model
# version of the token (0026): counts[layer, expert] as int64 bytes (little-endian, C order; lz4 on
# PostgreSQL, 0027) of a [layers, experts] layout, summed by numpy with agg_expert_load_delta's arrays.
agg_expert_load = Table(
    "agg_expert_load",
    metadata,
    Column("model_version", Integer, primary_key=True),
    Column("layers", Integer, nullable=False),
    Column("experts", Integer, nullable=False),
    Column("counts", LargeBinary, nullable=False),
)

# Rollout logprobs of the default samples' generated loss tokens, per model version: a
# histogram of fixed bins (trajstore.log._aggregate_counts.LOGPROB_RANGE / LOGPROB_BINS, the value
# clipped into the range) and the sum of the values in each bin (for the mean).
agg_logprobs = Table(
    "agg_logprobs",
    metadata,
    Column("model_version", Integer, primary_key=True),
    Column("bin", Integer, primary_key=True),
    Column("tokens", BigInteger, nullable=False),
    Column("logprob_sum", Float, nullable=False),
)

# The tables the append adds to (engine calls by model version and output length; route
# drift by time bucket; agg_calls and agg_trajectories below, migration 0019) hold DELTA
# rows: each append inserts its own rows (``delta`` true), never updating a row another append may hold, so concurrent
# appends do not wait on each other's row locks. A key's count is the SUM of its rows
# (one total row, ``delta`` false, unique per key, plus the deltas not yet folded
# into it); the background compaction folds deltas into the totals
# (``trajstore.log._aggregates.compact_event_aggregates``), as does
# ``trajstore report --rebuild-aggregates``.

# Engine calls (generation events with a model version) by model version and output length.
agg_output_lengths = Table(
    "agg_output_lengths",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("model_version", Integer, nullable=False),
    Column("output_len", Integer, nullable=False),
    Column("calls", BigInteger, nullable=False),
    Column("delta", Boolean, nullable=False),
    Index("ux_agg_output_lengths_total", "model_version", "output_len", unique=True,
          sqlite_where=text("NOT delta"), postgresql_where=text("NOT delta")),
    Index("ix_agg_output_lengths_delta", "id", sqlite_where=text("delta"), postgresql_where=text("delta")),
)

# Route drift of the calls that re-sent rows (route_rows_resent > 0), by time of append in
# buckets of ``width_s`` seconds (1, 60 and 3600: a panel's bucket width is a multiple of
# one of them) starting at unix second ``bucket_start``.
agg_route_drift = Table(
    "agg_route_drift",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("width_s", Integer, nullable=False),
    Column("bucket_start", BigInteger, nullable=False),
    Column("rows_resent", BigInteger, nullable=False),
    Column("rows_compared", BigInteger, nullable=False),
    Column("rows_drifted", BigInteger, nullable=False),
    Column("delta", Boolean, nullable=False),
    Index("ux_agg_route_drift_total", "width_s", "bucket_start", unique=True,
          sqlite_where=text("NOT delta"), postgresql_where=text("NOT delta")),
    Index("ix_agg_route_drift_delta", "id", sqlite_where=text("delta"), postgresql_where=text("delta")),
)

# migration 0019: engine calls by time of append (buckets of 1, 60 and 3600 seconds, as the
# route drift), model version (-1: none) and finish reason ('': none), counted in the append's
# transaction: what the run view's over-time call panels and the run's totals read. Delta rows
# as the two tables above: a key's count is the sum of its rows, ``max_output_len`` their max.
agg_calls = Table(
    "agg_calls",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("width_s", Integer, nullable=False),
    Column("bucket_start", BigInteger, nullable=False),
    Column("model_version", Integer, nullable=False),
    Column("finish_reason", String(64), nullable=False),
    Column("calls", BigInteger, nullable=False),
    Column("output_tokens", BigInteger, nullable=False),
    Column("observed_tokens", BigInteger, nullable=False),
    Column("prefix_mismatches", BigInteger, nullable=False),
    Column("calls_with_routes", BigInteger, nullable=False),
    Column("max_output_len", Integer, nullable=False),
    Column("route_rows_resent", BigInteger, nullable=False),
    Column("route_rows_compared", BigInteger, nullable=False),
    Column("route_rows_drifted", BigInteger, nullable=False),
    Column("delta", Boolean, nullable=False),
    Index("ux_agg_calls_total", "width_s", "bucket_start", "model_version", "finish_reason", unique=True,
          sqlite_where=text("NOT delta"), postgresql_where=text("NOT delta")),
    Index("ix_agg_calls_delta", "id", sqlite_where=text("delta"), postgresql_where=text("delta")),
)
# migration 0019: trajectories started (under status 'running') and finished (under their
# status) by time of append of the event, same buckets: the run view's running and problem
# panels. Delta rows, summed per key.
agg_trajectories = Table(
    "agg_trajectories",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("width_s", Integer, nullable=False),
    Column("bucket_start", BigInteger, nullable=False),
    Column("status", String(16), nullable=False),
    Column("started", BigInteger, nullable=False),
    Column("finished", BigInteger, nullable=False),
    Column("delta", Boolean, nullable=False),
    Index("ux_agg_trajectories_total", "width_s", "bucket_start", "status", unique=True,
          sqlite_where=text("NOT delta"), postgresql_where=text("NOT delta")),
    Index("ix_agg_trajectories_delta", "id", sqlite_where=text("delta"), postgresql_where=text("delta")),
)
# migration 0019: the running trajectories (the run view's stuck panel) through an index
Index("ix_trajectories_status", trajectories.c.status)

# migration 0020: what the materializer's commit counts of each finished trajectory it takes
# (from its index rows) and of its default samples, so the run view's per-trajectory and
# per-sample panels read small tables instead of the inspection views. One row per key (the
# key is the primary key), added to by the compaction (migration 0022: the commit inserts into
# the ``<table>_delta`` beside each); rewritten only by ``trajstore report --rebuild-aggregates``.

# One row per counted finished trajectory, as trajectory_summary gives it: the "trajectories to
# look at" panel reads the worst through the two ordered indexes (ORDER BY ... LIMIT), and a
# trajectory counted once is never counted again (a re-run commit, a release after a hold).
agg_trajectory_stats = Table(
    "agg_trajectory_stats",
    metadata,
    Column("trajectory_id", String(255), primary_key=True),
    Column("group_id", String(255), nullable=True),
    Column("status", String(16), nullable=False),
    Column("task", String(255), nullable=True),
    Column("finished_at", Float, nullable=False),  # its newest event's created_at
    Column("reward", Float, nullable=True),
    Column("num_generations", Integer, nullable=False),
    Column("num_generated_tokens", BigInteger, nullable=False),
    Column("num_samples", Integer, nullable=False),
    Column("num_prefix_mismatches", Integer, nullable=False),
    Column("num_placeholder_logprobs", BigInteger, nullable=False),
    Column("route_rows_drifted", BigInteger, nullable=True),
    Column("route_drift_share", Float, nullable=True),
)
Index("ix_agg_trajectory_stats_drift", agg_trajectory_stats.c.route_drift_share.desc(),
      agg_trajectory_stats.c.trajectory_id)
Index("ix_agg_trajectory_stats_tokens", agg_trajectory_stats.c.num_generated_tokens.desc(),
      agg_trajectory_stats.c.trajectory_id)


def _bucketed(name: str, *values: Column) -> Table:
    return Table(name, metadata, Column("width_s", Integer, primary_key=True),
                 Column("bucket_start", BigInteger, primary_key=True), *values)


# Rewards of finished trajectories by their finish time (buckets of 1, 60, 3600 s): the reward curve.
agg_rewards = _bucketed("agg_rewards", Column("rewarded", BigInteger, nullable=False),
                        Column("reward_sum", Float, nullable=False), Column("reward_min", Float, nullable=False),
                        Column("reward_max", Float, nullable=False))
# Finished trajectories by (engine calls, samples, prefix mismatches): merge ratio, prefix mismatches.
agg_trajectory_shapes = Table(
    "agg_trajectory_shapes", metadata,
    Column("num_generations", Integer, primary_key=True), Column("num_samples", Integer, primary_key=True),
    Column("num_prefix_mismatches", Integer, primary_key=True),
    Column("trajectories", BigInteger, nullable=False), Column("placeholder_logprobs", BigInteger, nullable=False))
# Finished trajectories per task (trajstore.log._aggregate_counts.TASK_KEYS of their metadata).
agg_tasks = Table(
    "agg_tasks", metadata, Column("task", String(255), primary_key=True),
    Column("trajectories", BigInteger, nullable=False), Column("rewarded", BigInteger, nullable=False),
    Column("reward_sum", Float, nullable=False), Column("generated_tokens", BigInteger, nullable=False),
    Column("calls", BigInteger, nullable=False), Column("failed", BigInteger, nullable=False))
# Finished trajectories per model version they generated at (-1: calls without one), as
# model_version_stats counts them (a call's version spans split).
agg_versions = Table(
    "agg_versions", metadata, Column("model_version", Integer, primary_key=True),
    Column("trajectories", BigInteger, nullable=False), Column("generated_tokens", BigInteger, nullable=False),
    Column("rewarded", BigInteger, nullable=False), Column("reward_sum", Float, nullable=False),
    Column("failed", BigInteger, nullable=False), Column("aborted", BigInteger, nullable=False),
    Column("multi_version", BigInteger, nullable=False))
# Finished trajectories' rewards per group, and the group's part of agg_group_variance as last
# counted (counted_*: NULL while it has none).
agg_groups = Table(
    "agg_groups", metadata, Column("group_id", String(255), primary_key=True),
    Column("trajectories", BigInteger, nullable=False), Column("rewarded", BigInteger, nullable=False),
    Column("reward_sum", Float, nullable=False), Column("reward_sumsq", Float, nullable=False),
    Column("reward_min", Float, nullable=True), Column("reward_max", Float, nullable=True),
    Column("finished_at", Float, nullable=False), Column("counted_at", Float, nullable=True),
    Column("counted_zero", Integer, nullable=True), Column("counted_variance", Float, nullable=True))
# Finished groups (none running, two or more rewarded) by the finish time of their last trajectory.
agg_group_variance = _bucketed("agg_group_variance", Column("groups", BigInteger, nullable=False),
                               Column("zero_variance_groups", BigInteger, nullable=False),
                               Column("variance_sum", Float, nullable=False))
# Default samples by kind of figure ('staleness', 'version_span', 'merged_calls', 'no_route': tokens
# without a captured route, for samples with routes) and its value (-1: NULL).
agg_samples = Table(
    "agg_samples", metadata, Column("kind", String(16), primary_key=True),
    Column("value", BigInteger, primary_key=True), Column("samples", BigInteger, nullable=False),
    Column("tokens", BigInteger, nullable=False), Column("route_rows", BigInteger, nullable=False))
# Default samples' staleness by their trajectory's finish time.
agg_staleness = _bucketed("agg_staleness", Column("samples", BigInteger, nullable=False),
                          Column("staled", BigInteger, nullable=False),
                          Column("staleness_sum", BigInteger, nullable=False),
                          Column("staleness_max", BigInteger, nullable=False),
                          Column("policy_version_max", BigInteger, nullable=False))
# migration 0024: the replay read token that records each run's lineage (the first to
# record it owns it; ``owner``: a digest of the token). Another read token cannot record it.
run_owners = Table(
    "run_owners", metadata,
    Column("run", String(255), primary_key=True),
    Column("owner", String(64), nullable=False),
    Column("created_at", Float, nullable=False),
)

# Each model version's first generation event: the newest version at a position, for staleness.
agg_policy_versions = Table(
    "agg_policy_versions", metadata, Column("model_version", Integer, primary_key=True),
    Column("first_position", BigInteger, nullable=False))

# The rollout ledger (docs/reference.md "Rollout ledger"): one row per group that
# trajectory_started events with run, prompt_id, epoch and group_size opened, its counts
# kept in the transaction of each append that starts or finishes one of its trajectories.
# num_finished: finished completed/truncated (whole at group_size); num_failed: the others.
ledger_groups = Table(
    "ledger_groups", metadata,
    Column("group_id", String(255), primary_key=True),
    Column("run", String(255), nullable=False),
    Column("prompt_id", String(255), nullable=False),
    Column("epoch", Integer, nullable=False),
    Column("group_size", Integer, nullable=False),
    Column("num_started", Integer, nullable=False),
    Column("num_finished", Integer, nullable=False),
    Column("num_failed", Integer, nullable=False),
    Column("started_position", BigInteger, nullable=False),  # its first trajectory_started
    Column("started_at", Float, nullable=False),
    Column("dropped_position", BigInteger, nullable=True),  # its group_dropped (NULL: not dropped)
    Column("dropped_reason", String(255), nullable=True),
    Column("dropped_at", Float, nullable=True),
    Index("ux_ledger_groups_prompt", "run", "prompt_id", "epoch", unique=True),
    Index("ix_ledger_groups_run_started", "run", "started_position"),
)

# migration 0022: the materializer's commit adds to none of the tables above. Its counts are
# rows of its own in a DELTA table beside each (same key and counted columns, any number of rows
# per key, no unique key: plain INSERTs, so two shards committing at once never wait on each
# other's rows); a key's count is the sum (min, max) of its rows in both tables
# (``trajstore.log._aggregate_counts.totals_sql``). The decode routes' expert load of a commit is ONE row
# per model version: its [layers, experts] int64 counts as bytes. A background compaction (the
# materializer's GC worker, and the end of a one-shot ``materialize``) moves the deltas into
# the totals above, exactly once (``trajstore.log._aggregates.compact_aggregates``), and
# settles the groups' part of agg_group_variance (written by it only).
_FOLD_DELTA_TABLES = ("agg_logprobs", "agg_rewards", "agg_trajectory_shapes", "agg_tasks", "agg_versions", "agg_groups",
                     "agg_samples", "agg_staleness", "agg_policy_versions")
_COUNTED_GROUP_COLUMNS = ("counted_at", "counted_zero", "counted_variance")


def _delta_table(total: Table) -> Table:
    cols = [Column(c.name, c.type, nullable=c.nullable) for c in total.columns if c.name not in _COUNTED_GROUP_COLUMNS]
    return Table(f"{total.name}_delta", metadata,
                 Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True), *cols)


_totals = {t.name: t for t in (agg_logprobs, agg_rewards, agg_trajectory_shapes, agg_tasks, agg_versions, agg_groups,
                               agg_samples, agg_staleness, agg_policy_versions)}
(agg_logprobs_delta, agg_rewards_delta, agg_trajectory_shapes_delta, agg_tasks_delta, agg_versions_delta,
 agg_groups_delta, agg_samples_delta, agg_staleness_delta, agg_policy_versions_delta) = \
    (_delta_table(_totals[name]) for name in _FOLD_DELTA_TABLES)
Index("ix_agg_groups_delta_group", agg_groups_delta.c.group_id)  # the compaction settles a group from its rows
# One commit's decode-route expert load of one model version: counts[layer, expert] (int64,
# little-endian, C order) of a [layers, experts] layout.
agg_expert_load_delta = Table(
    "agg_expert_load_delta",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("model_version", Integer, nullable=False),
    Column("layers", Integer, nullable=False),
    Column("experts", Integer, nullable=False),
    Column("counts", LargeBinary, nullable=False),
)
# The decode-route expert load is counted off the fold's critical path: a materializer commit
# of the default samples inserts one row naming its sample segment; the compaction counts the
# segment's samples into agg_expert_load and deletes the row in one transaction (exactly once).
agg_expert_pending = Table(
    "agg_expert_pending",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("segment", String(255), nullable=False),
)

__all__ = ["metadata", "log_head", "trajectories", "events", "segments", "samples", "materializer_checkpoints",
           "unfoldable_trajectories", "version_labels", "unresolved_labels", "store_settings", "projections",
           "projection_samples", "projection_checkpoints", "projection_unfoldable", "lineage_steps",
           "lineage_step_samples", "lineage_annotations", "lineage_annotation_versions", "agg_expert_load",
           "agg_logprobs", "agg_output_lengths", "agg_route_drift", "agg_calls", "agg_trajectories", "reader_leases",
           "agg_trajectory_stats", "agg_rewards", "agg_trajectory_shapes", "agg_tasks", "agg_versions", "agg_groups",
           "agg_group_variance", "agg_samples", "agg_staleness", "agg_policy_versions",
           "agg_logprobs_delta", "agg_rewards_delta", "agg_trajectory_shapes_delta", "agg_tasks_delta",
           "agg_versions_delta", "agg_groups_delta", "agg_samples_delta", "agg_staleness_delta",
           "agg_policy_versions_delta", "agg_expert_load_delta", "agg_expert_pending", "run_owners", "ledger_groups"]
