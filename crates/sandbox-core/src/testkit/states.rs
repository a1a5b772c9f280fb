//! The state-store suite: what every [`StateStore`] must do, run by each edition (memory,
//! file, Redis) against its own instances. Each scenario uses fixed keys of agent `a`, so give
//! it a store of its own (an empty directory, a fresh key prefix).

use std::sync::Arc;

use crate::error::Error;
use crate::isolation::{CallContext, IsolationKey, IsolationScope};
use crate::state_store::StateStore;

/// The user-scoped key of `user` under agent `a`.
pub fn key(user: &str) -> IsolationKey {
    IsolationKey::resolve(IsolationScope::User, &CallContext::new("a").user(user))
        .expect("a user key")
}

fn is_stale(r: &crate::Result<impl std::fmt::Debug>, token: u64, current: u64) -> bool {
    matches!(r, Err(Error::StaleLease { token: t, current: c, .. }) if *t == token && *c == current)
}

/// The contract on one empty store: loads, the fencing rules of `fence`, `save` and `delete`
/// (the fence survives a delete), and `list` with prefixes. Leaves `a/bob` saved (`{"v":9}`,
/// unfenced) and `a/alice` deleted with fence 7.
pub async fn contract(store: &dyn StateStore) {
    let (alice, bob) = (key("alice"), key("bob"));
    assert_eq!(store.load(&alice).await.unwrap(), None);
    assert_eq!(
        store.list("").await.unwrap(),
        vec![],
        "an empty store lists nothing"
    );
    assert_eq!(store.fence(&alice, Some(5)).await.unwrap(), 5);
    assert_eq!(
        store.list("").await.unwrap(),
        vec![],
        "a fence alone is not a state"
    );
    store.save(&alice, "{\"v\":1}", Some(5)).await.unwrap();
    // An unfenced key takes saves without a token.
    store.save(&bob, "{\"v\":9}", None).await.unwrap();
    assert_eq!(
        store.load(&alice).await.unwrap().as_deref(),
        Some("{\"v\":1}")
    );
    let err = store.save(&alice, "{\"v\":0}", Some(4)).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::StaleLease {
                token: 4,
                current: 5,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains(alice.as_str()), "{err}");
    assert_eq!(
        store.load(&alice).await.unwrap().as_deref(),
        Some("{\"v\":1}"),
        "stale save lost nothing"
    );
    assert!(
        is_stale(&store.save(&alice, "{}", None).await, 0, 5),
        "a fenced key refuses a save without a token"
    );
    // The same token again is the same holder: accepted (a retried save is idempotent).
    assert_eq!(store.fence(&alice, Some(5)).await.unwrap(), 5);
    store.save(&alice, "{\"v\":1}", Some(5)).await.unwrap();
    // A newer holder registers before it reads: from then on the old token is refused,
    // even though the newer holder has not saved anything yet.
    assert!(is_stale(&store.fence(&alice, Some(4)).await, 4, 5));
    assert_eq!(store.fence(&alice, Some(6)).await.unwrap(), 6);
    assert!(is_stale(
        &store.save(&alice, "{\"v\":3}", Some(5)).await,
        5,
        6
    ));
    // A guard without tokens: the store numbers the holders.
    assert_eq!(store.fence(&alice, None).await.unwrap(), 7);
    assert!(is_stale(
        &store.save(&alice, "{\"v\":3}", Some(6)).await,
        6,
        7
    ));
    store.save(&alice, "{\"v\":2}", Some(7)).await.unwrap();
    assert!(
        is_stale(&store.delete(&alice, Some(6)).await, 6, 7),
        "a stale delete is refused"
    );
    assert_eq!(
        store.load(&alice).await.unwrap().as_deref(),
        Some("{\"v\":2}"),
        "a refused delete removed nothing"
    );
    let mut listed: Vec<String> = store
        .list("")
        .await
        .unwrap()
        .iter()
        .map(|k| k.to_string())
        .collect();
    listed.sort();
    assert_eq!(listed, vec![alice.to_string(), bob.to_string()]);
    assert_eq!(
        store.list("agents/a/users/b").await.unwrap(),
        vec![bob.clone()]
    );
    assert_eq!(store.list("agents/b").await.unwrap(), vec![]);
    store.delete(&alice, Some(7)).await.unwrap();
    assert_eq!(store.load(&alice).await.unwrap(), None);
    assert_eq!(
        store.list("").await.unwrap(),
        vec![bob.clone()],
        "deleted states are not listed"
    );
    store
        .delete(&alice, Some(7))
        .await
        .expect("deleting a missing state is not an error");
    assert!(
        is_stale(&store.save(&alice, "{}", Some(5)).await, 5, 7),
        "fence survives delete"
    );
    assert_eq!(
        store.fence(&alice, None).await.unwrap(),
        8,
        "numbering continues after a delete"
    );
    assert_eq!(
        store.load(&bob).await.unwrap().as_deref(),
        Some("{\"v\":9}")
    );
}

/// Two instances over the same data (two replicas, two processes): a fence registered
/// through one binds writes through the other, and both read the same states.
pub async fn shared_between(one: &dyn StateStore, two: &dyn StateStore) {
    let carol = key("carol");
    assert_eq!(one.fence(&carol, None).await.unwrap(), 1);
    one.save(&carol, "{\"by\":\"one\"}", Some(1)).await.unwrap();
    assert_eq!(
        two.load(&carol).await.unwrap().as_deref(),
        Some("{\"by\":\"one\"}")
    );
    // The second replica's holder registers a newer token: the first one's writes are over.
    assert_eq!(two.fence(&carol, Some(10)).await.unwrap(), 10);
    assert!(is_stale(
        &one.save(&carol, "{\"by\":\"stale\"}", Some(1)).await,
        1,
        10
    ));
    assert!(is_stale(&one.delete(&carol, Some(9)).await, 9, 10));
    assert!(is_stale(&one.fence(&carol, Some(9)).await, 9, 10));
    two.save(&carol, "{\"by\":\"two\"}", Some(10))
        .await
        .unwrap();
    assert_eq!(
        one.load(&carol).await.unwrap().as_deref(),
        Some("{\"by\":\"two\"}")
    );
    // Store-issued numbers continue from the fence whichever instance issues them.
    assert_eq!(one.fence(&carol, None).await.unwrap(), 11);
    assert_eq!(two.fence(&carol, None).await.unwrap(), 12);
    assert!(is_stale(&two.save(&carol, "{}", Some(11)).await, 11, 12));
    assert_eq!(
        one.list("agents/a/users/carol").await.unwrap(),
        vec![carol.clone()]
    );
    two.delete(&carol, Some(12)).await.unwrap();
    assert_eq!(one.load(&carol).await.unwrap(), None);
}

/// Holders registering at the same time through several instances each get a distinct
/// token, and the fence ends at the highest: registration is atomic.
pub async fn concurrent_registrations(stores: &[Arc<dyn StateStore>]) {
    let dave = key("dave");
    let per_store = 8;
    let mut tasks = Vec::new();
    for store in stores {
        for _ in 0..per_store {
            let (store, dave) = (store.clone(), dave.clone());
            tasks.push(tokio::spawn(async move {
                store.fence(&dave, None).await.unwrap()
            }));
        }
    }
    let mut tokens = Vec::new();
    for t in tasks {
        tokens.push(t.await.unwrap());
    }
    tokens.sort_unstable();
    let n = (stores.len() * per_store) as u64;
    assert_eq!(tokens, (1..=n).collect::<Vec<_>>(), "one token per holder");
    assert!(is_stale(
        &stores[0].save(&dave, "{}", Some(n - 1)).await,
        n - 1,
        n
    ));
    stores[stores.len() - 1]
        .save(&dave, "{}", Some(n))
        .await
        .unwrap();
}
