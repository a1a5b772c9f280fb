//! Hostile chunked snapshots: a store and a state under an attacker's control, whose manifest
//! references carry lengths and offsets far beyond the objects they point at (the shapes of
//! the attack probe: a whole-blob reference of 64,424,509,440 bytes over a 6-byte blob aborted
//! the process). Each must fail its call with `RestoreIncomplete`, leave the stored state
//! alone, and leave the previous snapshot restorable.

use super::{Env, Fixture, call, checkpoint_holds, sh, spec};
use crate::backend::{EntryType, Persistence};
use crate::error::Error;
use crate::isolation::{IsolationKey, IsolationScope};
use crate::sandbox::SandboxConfig;
use crate::snapshot::{BlobKey, ChunkRef, SnapshotFormat, chunk_key, load_manifest};
use crate::state::{state_from_json, state_to_json};
use crate::state_store::StateStore;
use crate::stream;

/// The hostile references, by name: each over the 6-byte blob `hello\n` (or a pack of it).
fn shapes(hash: &str, pack: crate::snapshot::PackId) -> Vec<(&'static str, ChunkRef)> {
    let h = || hash.to_owned();
    vec![
        (
            "whole blob of 64,424,509,440 bytes",
            ChunkRef::whole(h(), 64_424_509_440),
        ),
        ("whole blob of 2^36 bytes", ChunkRef::whole(h(), 1 << 36)),
        (
            "bundle slice of 2^36 bytes",
            ChunkRef::slice(h(), 1 << 36, 0),
        ),
        ("bundle offset 2^36", ChunkRef::slice(h(), 6, 1 << 36)),
        ("bundle slice past the blob", ChunkRef::slice(h(), 6, 3)),
        (
            "pack piece of 2^36 bytes",
            ChunkRef::packed(h(), 1 << 36, pack, 0),
        ),
        (
            "pack piece of the largest length",
            ChunkRef::packed(h(), crate::snapshot::pack::MAX_PIECE_LEN, pack, 0),
        ),
        ("pack offset 2^36", ChunkRef::packed(h(), 6, pack, 1 << 36)),
        (
            "pack offset at the end of u64",
            ChunkRef::packed(h(), 6, pack, u64::MAX - 6),
        ),
    ]
}

/// See the module docs. Runs on the fixture's snapshot store, with the chunked format.
pub(super) async fn hostile_chunked_snapshots(fx: &dyn Fixture, env: &Env) {
    let m = env.manager(
        fx.client(Persistence::Ephemeral).await,
        IsolationScope::Session,
        SandboxConfig::new(spec()).snapshots(env.snapshot_spec().format(SnapshotFormat::Chunked)),
    );
    let ctx = env.ctx().session("hostile-chunked");
    let key = IsolationKey::resolve(IsolationScope::Session, &ctx).expect("key");
    let first = call(&m, &ctx, |sb| async move {
        sh(&sb, "echo v1 > v.txt").await;
    })
    .await;
    let first_json = first.state_json.clone().expect("state");
    let snap = state_from_json(&first_json)
        .expect("state")
        .common()
        .snapshot
        .clone()
        .expect("snapshot");
    let manifest = load_manifest(&env.snapshot_spec(), &snap)
        .await
        .expect("manifest");

    // What the attacker stores: a 6-byte chunk blob and a 6-byte pack.
    let small = b"hello\n";
    let hash = blake3::hash(small).to_hex().to_string();
    env.snapshots
        .put(
            &chunk_key(&hash).expect("key"),
            stream::once(&small[..]),
            None,
        )
        .await
        .expect("blob");
    let pack = crate::snapshot::PackId::generate();
    env.snapshots
        .put(&pack.key(), stream::once(&small[..]), None)
        .await
        .expect("pack");

    for (i, (name, chunk)) in shapes(&hash, pack).into_iter().enumerate() {
        let mut hostile = (*manifest).clone();
        let entry = hostile
            .entries
            .iter_mut()
            .find(|e| e.path.as_str() == "v.txt" && e.kind == EntryType::File)
            .expect("v.txt in the manifest");
        entry.size = chunk.len;
        entry.hash = Some(hash.clone());
        entry.chunks = vec![chunk];
        let bytes = hostile.to_bytes();
        let manifest_key =
            BlobKey::new(format!("{}-hostile-{i}", snap.manifest)).expect("manifest key");
        env.snapshots
            .put(&manifest_key, stream::once(bytes.clone()), None)
            .await
            .expect("hostile manifest");
        let mut state = state_from_json(&first_json).expect("state");
        let mut hostile_ref = snap.clone();
        hostile_ref.manifest = manifest_key;
        hostile_ref.manifest_size = bytes.len() as u64;
        hostile_ref.manifest_blake3 = blake3::hash(&bytes).to_hex().to_string();
        state.common_mut().snapshot = Some(hostile_ref);
        let stored = state_to_json(&*state).expect("json");
        env.states
            .save(&key, &stored, Some(u64::MAX))
            .await
            .expect("save");

        let err = m.call(&ctx, |_| async {}).await.expect_err(name).error;
        assert!(
            matches!(err, Error::RestoreIncomplete { .. }),
            "{name}: {err}"
        );
        assert_eq!(
            env.states.load(&key).await.expect("load").as_deref(),
            Some(stored.as_str()),
            "{name}: state untouched"
        );
    }

    // The previous snapshot still restores.
    checkpoint_holds(&m, &ctx, Some(&first_json), "v.txt", "v1\n").await;
}
