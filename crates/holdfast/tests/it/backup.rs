//! Backup and restore, the "all servers lost" runbook of docs/operations.md: `holdfast snapshot save`
//! from a running cluster, every server lost, `holdfast snapshot restore` into new data dirs of a new
//! cluster on other addresses, which then serves the same table.

use crate::harness::{Cluster, Options};
use std::collections::BTreeMap;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_restores_into_a_new_cluster_with_the_same_table() {
    let keep = tempfile::tempdir().unwrap();
    let file = keep.path().join("holdfast.backup");
    let a = Cluster::start(Options {
        nodes: 3,
        groups: 2,
        ..Options::default()
    })
    .await;
    let client = a.client().await;
    let session = client.open_session(Duration::from_secs(30)).await.unwrap();
    let mut held = Vec::new();
    for i in 0..6 {
        let name = format!("backup/held-{i}");
        let g = session.acquire(&name).await.unwrap();
        held.push((name, g.token()));
        std::mem::forget(g); // stays held; the session is what the restored cluster must keep
    }
    for i in 0..40 {
        let g = session
            .acquire(&format!("backup/cycle-{}", i % 4))
            .await
            .unwrap();
        g.release().await.unwrap();
    }
    // A session whose id and secret the test keeps, holding a lock in group 0: after the restore, its
    // old client must not be able to renew it.
    let raw_name = (0..)
        .map(|i| format!("backup/raw-{i}"))
        .find(|n| holdfast_lock_table::group_for(n, 2).0 == 0)
        .unwrap();
    let mut raw = a
        .raw(a.wait_for_leader(0, Duration::from_secs(30)).await)
        .await;
    let (raw_session, raw_secret) = crate::abandon::raw_session(&mut raw, 60_000, 7).await;
    raw.acquire(holdfast_proto::v1::AcquireRequest {
        group: 0,
        session_id: raw_session,
        request_id: 1,
        name: raw_name.clone(),
        session_secret: raw_secret.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let old_cluster = a.cluster_id().await;

    let out = a
        .holdfast()
        .args(["snapshot", "save"])
        .arg(&file)
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // "group G: index I, digest D, N bytes"
    let saved: BTreeMap<u32, (u64, u64)> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("group ")?;
            let (g, rest) = rest.split_once(": index ")?;
            let (index, rest) = rest.split_once(", digest ")?;
            let digest = rest.split(',').next()?;
            Some((
                g.parse().ok()?,
                (index.parse().ok()?, u64::from_str_radix(digest, 16).ok()?),
            ))
        })
        .collect();
    assert_eq!(saved.len(), 2, "{text}");
    for (g, (_, digest)) in &saved {
        assert_eq!(a.wait_converged(*g, Duration::from_secs(20)).await, *digest);
    }

    // The old cluster goes on after the backup: its later tokens must stay below the restored cluster's.
    let mut old_tokens = Vec::new();
    for i in 0..20 {
        let g = session
            .acquire(&format!("backup/cycle-{}", i % 4))
            .await
            .unwrap();
        old_tokens.push(g.token());
        g.release().await.unwrap();
    }
    let old_max = *old_tokens.iter().max().unwrap();
    assert!(saved.values().all(|(index, _)| *index < old_max));
    drop(raw);

    // Every server is lost.
    drop(session);
    drop(client);
    drop(a);

    // A damaged backup is refused before anything is written.
    let mut damaged = std::fs::read(&file).unwrap();
    let mid = damaged.len() / 2;
    damaged[mid] ^= 0x40;
    let bad = keep.path().join("damaged.backup");
    std::fs::write(&bad, &damaged).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_holdfast"))
        .args(["snapshot", "restore"])
        .arg(&bad)
        .arg("--data-dir")
        .arg(keep.path().join("never"))
        .args([
            "--node-id",
            "1",
            "--members",
            "1=h:1/h:2,2=h:3/h:4,3=h:5/h:6",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("checksum mismatch"));
    assert!(!keep.path().join("never").exists());

    // A new cluster, on new ports, seeded from the backup.
    let b = Cluster::start(Options {
        nodes: 3,
        groups: 2,
        restore: Some(file.clone()),
        ..Options::default()
    })
    .await;
    // The restored tables are the backup's with every session re-keyed for the new cluster.
    let new_cluster = u64::from_str_radix(&b.cluster_id().await, 16).unwrap();
    let backup = holdfast_server::backup::Backup::decode(&std::fs::read(&file).unwrap()).unwrap();
    for g in &backup.groups {
        let expected = holdfast_server::backup::restored_table(g, new_cluster).unwrap();
        let expected = holdfast_lock_table::LockTable::decode_snapshot(&expected).unwrap();
        assert_ne!(
            expected.digest(),
            saved[&g.group].1,
            "the sessions were not re-keyed"
        );
        assert_eq!(
            b.wait_converged(g.group, Duration::from_secs(30)).await,
            expected.digest(),
            "group {}: the restored table differs from the backup's",
            g.group
        );
    }
    assert_ne!(b.cluster_id().await, old_cluster);
    // The old client of a restored session cannot renew it: its secret is no longer the session's.
    let mut raw = b
        .raw(b.wait_for_leader(0, Duration::from_secs(30)).await)
        .await;
    let refused = raw
        .keep_alive(holdfast_proto::v1::KeepAliveRequest {
            group: 0,
            session_ids: vec![raw_session],
            session_secrets: vec![raw_secret.into()],
            ..Default::default()
        })
        .await
        .expect_err("the lost cluster's client renewed its session on the restored cluster");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    // Nor get it back, new secret and all, by opening again with the nonce it was opened with.
    let (reopened, _) = crate::abandon::raw_session(&mut raw, 60_000, 7).await;
    assert_ne!(
        reopened, raw_session,
        "a replayed open returned the restored session"
    );
    let client = b.client().await;
    for (name, token) in &held {
        let info = client.describe(name).await.unwrap().expect("still held");
        assert_eq!(info.token, *token);
        // The holder's session got a fresh TTL from the new leader, as after a failover.
        assert!(
            info.holder_ttl_remaining_ms > 20_000,
            "{name}: {} ms left",
            info.holder_ttl_remaining_ms
        );
    }
    // Fencing tokens continue above everything in the backup, and above what the lost cluster issued
    // after it.
    let s = client.open_session(Duration::from_secs(10)).await.unwrap();
    for i in 0..4 {
        let name = format!("backup/cycle-{i}");
        let g = s.acquire(&name).await.unwrap();
        let group = holdfast_lock_table::group_for(&name, 2).0;
        assert!(
            g.token() > saved[&group].0 && g.token() > old_max,
            "{name}: token {} not above the backup ({}) and the old cluster ({old_max})",
            g.token(),
            saved[&group].0
        );
        g.release().await.unwrap();
    }
}
