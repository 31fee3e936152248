//! README.md's table of broker permissions is the one in code
//! (`Permissions::for_role`), so the documented, demoed and tested
//! permissions cannot drift.

use vq_common::topology::{Permissions, Role};

/// The block README.md shows, rendered from [`Permissions::for_role`] with
/// the cluster written as `<c>`.
fn table() -> String {
    let mut out = String::new();
    for role in Role::ALL {
        let p = Permissions::for_role(role, "<c>");
        for (i, (op, re)) in [
            ("configure", &p.configure),
            ("write", &p.write),
            ("read", &p.read),
        ]
        .into_iter()
        .enumerate()
        {
            let name = if i == 0 { role.name() } else { "" };
            out.push_str(&format!("{name:<12}{op:<11}{re}\n"));
        }
    }
    out
}

#[test]
fn the_readme_gives_exactly_the_permissions_of_every_role() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("read README.md");
    let table = table();
    assert!(
        readme.contains(&format!("```text\n{table}```")),
        "README.md, \"Broker accounts and trust\", must show exactly:\n```text\n{table}```"
    );
}
