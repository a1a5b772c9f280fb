use std::time::Duration;

use sandbox_core::ErrorKind;

use super::*;
use crate::filesystem::FilesystemExt as _;
use crate::types::{EditRequest, GlobOptions};

struct Env {
    _tmp: tempfile::TempDir,
    project: PathBuf,
    ws: PathBuf,
    extra: PathBuf,
}

fn env() -> Env {
    let tmp = tempfile::tempdir().unwrap();
    let project = tmp.path().join("project");
    let ws = tmp.path().join("ws");
    let extra = tmp.path().join("extra");
    for d in [&project, &ws, &extra] {
        fs::create_dir_all(d).unwrap();
    }
    Env {
        project: project.canonicalize().unwrap(),
        ws: ws.canonicalize().unwrap(),
        extra: extra.canonicalize().unwrap(),
        _tmp: tmp,
    }
}

fn open(e: &Env, options: LocalOptions) -> LocalFs {
    LocalFs::new(options.project(&e.project).workspace(&e.ws)).unwrap()
}

fn escape(r: Result<impl fmt::Debug>) -> String {
    match r {
        Err(Error::PathEscape { reason, .. }) => reason,
        other => panic!("expected PathEscape, got {other:?}"),
    }
}

#[tokio::test]
async fn default_workspace_lives_under_the_project() {
    let e = env();
    let fs = LocalFs::new(LocalOptions::default().project(&e.project)).unwrap();
    assert_eq!(fs.workspace_dir(), e.project.join(DEFAULT_WORKSPACE_DIR));
    // The workspace directory is not part of the project layer's listing.
    fs.write("a.txt", "x".into()).await.unwrap();
    let names: Vec<String> = fs
        .list("")
        .await
        .unwrap()
        .iter()
        .map(|i| i.path.clone())
        .collect();
    assert_eq!(names, ["a.txt"]);
    assert!(
        fs.walk("")
            .await
            .unwrap()
            .iter()
            .all(|i| !i.path.contains(".sandbox-harness"))
    );
}

#[tokio::test]
async fn overlay_reads_down_writes_up_and_copies_up_on_edit() {
    let e = env();
    fs::write(e.project.join("README.md"), "project readme\n").unwrap();
    fs::create_dir_all(e.project.join("src")).unwrap();
    fs::write(e.project.join("src/lib.rs"), "fn a() {}\n").unwrap();
    let fs = open(&e, LocalOptions::default());
    assert_eq!(
        &fs.read("README.md").await.unwrap()[..],
        b"project readme\n"
    );
    // Writing a project path: the copy lands in the workspace, the project is untouched.
    let out = fs.write("README.md", "mine\n".into()).await.unwrap();
    assert!(!out.created, "the file was visible before");
    assert_eq!(
        fs::read_to_string(e.ws.join("README.md")).unwrap(),
        "mine\n"
    );
    assert_eq!(
        fs::read_to_string(e.project.join("README.md")).unwrap(),
        "project readme\n"
    );
    assert_eq!(&fs.read("README.md").await.unwrap()[..], b"mine\n");
    // Editing a lower file copies it up.
    fs.edit("src/lib.rs", EditRequest::new("fn a", "fn b"))
        .await
        .unwrap();
    assert_eq!(
        fs::read_to_string(e.ws.join("src/lib.rs")).unwrap(),
        "fn b() {}\n"
    );
    assert_eq!(
        fs::read_to_string(e.project.join("src/lib.rs")).unwrap(),
        "fn a() {}\n"
    );
    // Listings merge, the upper layer winning.
    fs::write(e.project.join("src/extra.rs"), "x").unwrap();
    let listed = fs.list("src").await.unwrap();
    let got: Vec<(&str, u64)> = listed.iter().map(|i| (i.path.as_str(), i.size)).collect();
    assert_eq!(got, [("src/extra.rs", 1), ("src/lib.rs", 10)]);
    let globbed = fs.glob("*.rs", GlobOptions::default()).await.unwrap();
    assert_eq!(globbed.files.len(), 2);
    // Deleting a project-only file is refused in this mode; the message says why.
    let err = fs.delete("src/extra.rs").await.unwrap_err();
    assert!(err.to_string().contains("read-only project"), "{err}");
    // Absolute paths under the project are readable, not writable.
    let abs = e.project.join("src/extra.rs").display().to_string();
    assert_eq!(&fs.read(&abs).await.unwrap()[..], b"x");
    assert!(fs.write(&abs, "y".into()).await.is_err());
}

#[tokio::test]
async fn project_writable_routes_code_to_the_project_and_metadata_to_the_workspace() {
    let e = env();
    let fs = open(&e, LocalOptions::default().project_writable(true));
    for p in ["src/App.java", "pom.xml", "README.md"] {
        fs.write(p, "code".into()).await.unwrap();
        assert!(e.project.join(p).is_file(), "{p}");
        assert!(!e.ws.join(p).exists(), "{p}");
    }
    for p in [
        "MEMORY.md",
        "memory/a.md",
        "agents/x/sessions/1.json",
        "skills/s/SKILL.md",
        "knowledge/k.md",
        "plans/p.md",
        "subagents/s.md",
        "rules/r.md",
        "tools.json",
    ] {
        fs.write(p, "meta".into()).await.unwrap();
        assert!(e.ws.join(p).is_file(), "{p}");
        assert!(!e.project.join(p).exists(), "{p}");
    }
    fs.delete("pom.xml").await.unwrap();
    assert!(!e.project.join("pom.xml").exists());
}

#[tokio::test]
async fn rooted_policy_admits_only_the_roots_by_component() {
    let e = env();
    let user1 = e.extra.join("user1");
    let user10 = e.extra.join("user10");
    fs::create_dir_all(&user1).unwrap();
    fs::create_dir_all(&user10).unwrap();
    fs::write(user10.join("f"), "other").unwrap();
    let fs = open(&e, LocalOptions::default().add_root(&user1));
    fs.write(&user1.join("ok.txt").display().to_string(), "fine".into())
        .await
        .unwrap();
    assert_eq!(fs::read_to_string(user1.join("ok.txt")).unwrap(), "fine");
    // `/…/user10` shares a string prefix with `/…/user1` but is not under it.
    let reason = escape(fs.read(&user10.join("f").display().to_string()).await);
    assert!(reason.contains("outside the allowed roots"), "{reason}");
    escape(fs.read(&format!("{}/../user10/f", user1.display())).await);
    escape(fs.read("/etc/passwd").await);
    // Absolute paths under the workspace work.
    fs.write("w.txt", "w".into()).await.unwrap();
    assert_eq!(
        &fs.read(&e.ws.join("w.txt").display().to_string())
            .await
            .unwrap()[..],
        b"w"
    );
}

#[tokio::test]
async fn sandboxed_policy_refuses_absolute_paths() {
    let e = env();
    let fs = open(&e, LocalOptions::default().policy(PathPolicy::Sandboxed));
    fs.write("a.txt", "a".into()).await.unwrap();
    let reason = escape(fs.read(&e.ws.join("a.txt").display().to_string()).await);
    assert!(
        reason.contains("absolute paths are not allowed"),
        "{reason}"
    );
    escape(fs.read("../ws/a.txt").await);
    assert_eq!(&fs.read("a.txt").await.unwrap()[..], b"a");
}

#[tokio::test]
async fn unrestricted_policy_passes_absolute_paths() {
    let e = env();
    let fs = open(&e, LocalOptions::default().policy(PathPolicy::Unrestricted));
    let outside = e.extra.join("anything.txt");
    fs.write(&outside.display().to_string(), "x".into())
        .await
        .unwrap();
    assert_eq!(fs::read_to_string(&outside).unwrap(), "x");
    // Relative paths still may not climb.
    escape(fs.read("../extra/anything.txt").await);
}

#[tokio::test]
async fn symlinks_are_checked_on_the_resolved_path() {
    let e = env();
    fs::write(e.extra.join("secret"), "s").unwrap();
    let fs = open(&e, LocalOptions::default());
    std::os::unix::fs::symlink(e.extra.join("secret"), e.ws.join("leak")).unwrap();
    std::os::unix::fs::symlink(&e.extra, e.ws.join("out")).unwrap();
    std::os::unix::fs::symlink(e.project.join("p.txt"), e.ws.join("inside")).unwrap();
    fs::write(e.project.join("p.txt"), "p").unwrap();
    escape(fs.read("leak").await);
    escape(fs.read("out/secret").await);
    escape(fs.write("out/new", "x".into()).await);
    escape(fs.list("out").await);
    assert!(!e.extra.join("new").exists());
    // A link that stays inside the roots is followed.
    assert_eq!(&fs.read("inside").await.unwrap()[..], b"p");
    // The same link is admitted once its target directory is an extra root.
    let fs = open(&e, LocalOptions::default().add_root(&e.extra));
    assert_eq!(&fs.read("leak").await.unwrap()[..], b"s");
}

#[tokio::test]
async fn links_that_stay_inside_a_root_work_everywhere() {
    let e = env();
    // A venv's layout: relative links inside the workspace.
    fs::create_dir_all(e.ws.join("venv/lib64/python")).unwrap();
    fs::write(e.ws.join("venv/lib64/python/site.py"), "site").unwrap();
    std::os::unix::fs::symlink("lib64", e.ws.join("venv/lib")).unwrap();
    std::os::unix::fs::symlink("../venv/lib64/python/site.py", e.ws.join("venv/site")).unwrap();
    let fs = open(&e, LocalOptions::default());
    assert_eq!(
        &fs.read("venv/lib/python/site.py").await.unwrap()[..],
        b"site"
    );
    assert_eq!(&fs.read("venv/site").await.unwrap()[..], b"site");
    let listed: Vec<String> = fs
        .list("venv/lib")
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.path)
        .collect();
    assert_eq!(listed, ["venv/lib/python"]);
    let walked: Vec<String> = fs
        .walk("venv/lib")
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.path)
        .collect();
    assert_eq!(walked, ["venv/lib/python/site.py"]);
    // Writing through the parent link lands inside; a link at the name is replaced.
    fs.write("venv/lib/python/new.py", "new".into())
        .await
        .unwrap();
    assert_eq!(
        fs::read_to_string(e.ws.join("venv/lib64/python/new.py")).unwrap(),
        "new"
    );
    fs.write("venv/site", "replaced".into()).await.unwrap();
    assert!(
        fs::symlink_metadata(e.ws.join("venv/site"))
            .unwrap()
            .is_file()
    );
    assert_eq!(
        fs::read_to_string(e.ws.join("venv/lib64/python/site.py")).unwrap(),
        "site"
    );
    // A relative link that climbs out of the workspace is refused, even into the project.
    fs::write(e.project.join("p.txt"), "p").unwrap();
    std::os::unix::fs::symlink("../project/p.txt", e.ws.join("climb")).unwrap();
    escape(fs.read("climb").await);
}

#[tokio::test]
async fn roots_are_held_open_so_a_swapped_root_path_leads_nowhere_else() {
    let e = env();
    let outside = e.extra.join("outside");
    fs::create_dir_all(&outside).unwrap();
    let fs = LocalFs::new(LocalOptions::default().project(&e.project)).unwrap();
    fs.write("a.txt", "before".into()).await.unwrap();
    // The shell (cwd = project) moves the workspace's parent away and plants a link to
    // outside in its place: operations keep using the directory opened at construction.
    let moved = e.project.join("moved");
    fs::rename(e.project.join(WORKSPACE_PARENT), &moved).unwrap();
    std::os::unix::fs::symlink(&outside, e.project.join(WORKSPACE_PARENT)).unwrap();
    fs.write("b.txt", "after".into()).await.unwrap();
    assert_eq!(
        fs::read_to_string(moved.join("workspace/b.txt")).unwrap(),
        "after"
    );
    assert_eq!(&fs.read("a.txt").await.unwrap()[..], b"before");
    assert_eq!(fs::read_dir(&outside).unwrap().count(), 0);
    // A user's directory replaced by a link to outside is refused, not followed.
    let ws = moved.join("workspace");
    std::os::unix::fs::symlink(&outside, ws.join("mallory")).unwrap();
    let mallory = fs.for_user("mallory");
    escape(mallory.write("MEMORY.md", "m".into()).await);
    escape(mallory.read("MEMORY.md").await);
    assert_eq!(fs::read_dir(&outside).unwrap().count(), 0);
}

#[tokio::test]
async fn users_get_their_own_files_and_skill_overrides() {
    let e = env();
    let fs = open(&e, LocalOptions::default());
    fs.write("skills/review/SKILL.md", "shared skill".into())
        .await
        .unwrap();
    fs.write("skills/review/helper.py", "shared helper".into())
        .await
        .unwrap();
    fs.write("skills/other/SKILL.md", "other".into())
        .await
        .unwrap();
    fs.write("AGENTS.md", "persona".into()).await.unwrap();
    let alice = fs.for_user("alice");
    let bob = fs.for_user("bob");
    alice
        .write("MEMORY.md", "alice remembers".into())
        .await
        .unwrap();
    bob.write("memory/notes.md", "bob notes".into())
        .await
        .unwrap();
    assert_eq!(
        fs::read_to_string(e.ws.join("alice/MEMORY.md")).unwrap(),
        "alice remembers"
    );
    assert_eq!(
        fs::read_to_string(e.ws.join("bob/memory/notes.md")).unwrap(),
        "bob notes"
    );
    assert_eq!(kind(bob.read("MEMORY.md").await), ErrorKind::NotFound);
    // Static assets are shared.
    assert_eq!(&alice.read("AGENTS.md").await.unwrap()[..], b"persona");
    // Alice's skill directory replaces the shared one of that name, for her only.
    alice
        .write("skills/review/SKILL.md", "alice's skill".into())
        .await
        .unwrap();
    assert_eq!(
        &alice.read("skills/review/SKILL.md").await.unwrap()[..],
        b"alice's skill"
    );
    assert_eq!(
        kind(alice.read("skills/review/helper.py").await),
        ErrorKind::NotFound
    );
    assert_eq!(
        &alice.read("skills/other/SKILL.md").await.unwrap()[..],
        b"other"
    );
    assert_eq!(
        &bob.read("skills/review/SKILL.md").await.unwrap()[..],
        b"shared skill"
    );
    let walked: Vec<String> = alice
        .walk("skills")
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.path)
        .collect();
    assert_eq!(walked, ["skills/other/SKILL.md", "skills/review/SKILL.md"]);
    // Users cannot reach into each other's directories, by relative or absolute path.
    escape(bob.read("alice/MEMORY.md").await);
    escape(
        bob.read(&e.ws.join("alice/MEMORY.md").display().to_string())
            .await,
    );
    escape(fs.read("alice/MEMORY.md").await);
    // Nor through a symlink.
    std::os::unix::fs::symlink(e.ws.join("alice"), e.ws.join("peek")).unwrap();
    escape(bob.read("peek/MEMORY.md").await);
    // User directories do not show up in listings.
    let root: Vec<String> = bob
        .list("")
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.path)
        .collect();
    assert!(!root.iter().any(|p| p == "alice"), "{root:?}");
    assert!(root.contains(&"memory".to_owned()));
    // A user id cannot collide with a metadata directory or climb.
    let tricky = fs.for_user("memory");
    tricky.write("MEMORY.md", "t".into()).await.unwrap();
    assert!(!e.ws.join("memory/MEMORY.md").exists());
    fs.for_user("../x")
        .write("MEMORY.md", "t".into())
        .await
        .unwrap();
    assert!(!e.ws.join("../x").exists());
}

fn kind<T: fmt::Debug>(r: Result<T>) -> ErrorKind {
    r.unwrap_err().kind()
}

#[tokio::test]
async fn shell_runs_in_the_project_with_a_minimal_env() {
    let e = env();
    fs::write(e.project.join("in-project.txt"), "").unwrap();
    let fs = open(&e, LocalOptions::default().env("GREETING", "hi"));
    let r = fs
        .execute("pwd; ls; echo $GREETING; env | wc -l", None)
        .await
        .unwrap();
    let out = r.stdout_str().to_string();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], e.project.display().to_string());
    assert!(lines.contains(&"in-project.txt"));
    assert!(lines.contains(&"hi"));
    let vars: usize = lines.last().unwrap().trim().parse().unwrap();
    assert!(
        vars <= 8,
        "a minimal environment, got {vars} variables: {out}"
    );
    let inherit = open(&e, LocalOptions::default().inherit_env(true));
    let r = inherit.execute("env | wc -l", None).await.unwrap();
    assert!(r.success());
    let r = fs
        .execute("sleep 5", Some(Duration::from_millis(200)))
        .await
        .unwrap();
    assert!(r.timed_out);
    let no_shell = open(&e, LocalOptions::default().shell(false));
    assert_eq!(
        kind(no_shell.execute("true", None).await),
        ErrorKind::NotSupported
    );
}

#[tokio::test]
async fn output_cap_is_configurable() {
    let e = env();
    let fs = open(&e, LocalOptions::default().max_output_bytes(10));
    let r = fs
        .execute("echo 0123456789abcdef; echo err >&2", None)
        .await
        .unwrap();
    assert_eq!(&r.stdout[..], b"0123456789");
    assert!(r.stdout_truncated && !r.stderr_truncated);
}

#[test]
fn options_debug_hides_env_values() {
    let o = LocalOptions::default().env("TOKEN", "s3cret");
    let shown = format!("{o:?}");
    assert!(shown.contains("TOKEN") && !shown.contains("s3cret"));
}
