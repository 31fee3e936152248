//! Unit tests of [`super`]: walltime, resource lists, `#PBS` directives
//! and job names.

use super::*;

fn given(v: &str) -> VarValue {
    VarValue::Given(v.into())
}

#[test]
fn walltime_accepts_torque_forms() {
    assert_eq!(parse_walltime("45").unwrap(), 45);
    assert_eq!(parse_walltime("01:30").unwrap(), 90);
    assert_eq!(parse_walltime("01:00:00").unwrap(), 3600);
    assert_eq!(parse_walltime("100:00:00").unwrap(), 360_000);
    assert_eq!(parse_walltime("90:00").unwrap(), 5400);
    assert_eq!(
        parse_walltime("1:02:03:04").unwrap(),
        86_400 + 7200 + 180 + 4
    );
    assert_eq!(parse_walltime("3600").unwrap(), 3600);
    assert_eq!(parse_walltime("0:0:5").unwrap(), 5);
    assert_eq!(
        parse_walltime("00:00:01.500").unwrap(),
        2,
        "fraction rounds up"
    );
    assert_eq!(parse_walltime("10.000").unwrap(), 10);
}

#[test]
fn walltime_rejects_garbage_and_out_of_range_fields() {
    for bad in [
        "",
        "abc",
        "1:",
        ":1",
        "1::2",
        "1:60",
        "1:60:00",
        "1:00:60",
        "1:24:00:00",
        "1:2:3:4:5",
        "-5",
        "+5",
        " 5",
        "5 ",
        "1h",
        "00:00:00",
        "0",
        "1.x",
        "1.",
        "1:0100",
        "99999999999999999999999",
        "213503982334601:00:00:00",
        "36500000:00:00:00",
    ] {
        let err = parse_walltime(bad).expect_err(bad);
        assert!(matches!(err, PbsError::Walltime { .. }), "{bad}: {err:?}");
    }
}

#[test]
fn walltime_formats_as_hh_mm_ss() {
    assert_eq!(format_walltime(0), "00:00:00");
    assert_eq!(format_walltime(3661), "01:01:01");
    assert_eq!(format_walltime(360_000), "100:00:00");
}

proptest::proptest! {
    #[test]
    fn walltime_round_trips(secs in 1u64..=MAX_WALLTIME_SECS) {
        proptest::prop_assert_eq!(parse_walltime(&format_walltime(secs)).unwrap(), secs);
    }

    #[test]
    fn walltime_parser_never_panics(s in "[0-9:.]{0,30}") {
        let _ = parse_walltime(&s);
    }

    #[test]
    fn script_parser_never_panics(s in "(#PBS [-a-zA-Z0-9=:,'\" @/]{0,40}\n){0,5}") {
        let _ = parse_script(&s);
    }
}

#[test]
fn a_typical_script_is_parsed() {
    let script = "#!/bin/bash\n\
        #PBS -N sim_42\n\
        #PBS -q cms\n\
        #PBS -l walltime=02:00:00,nodes=1:ppn=4\n\
        #PBS -j oe\n\
        #PBS -o logs/out.txt\n\
        #PBS -v FOO=bar,HOME_DIR\n\
        #PBS -V\n\
        #PBS -d /scratch/u\n\
        #PBS -S /bin/bash\n\
        #PBS -r n\n\
        #PBS -W umask=027,group_list=cms\n\
        \n\
        # a comment\n\
        echo hello\n";
    let d = parse_script(script).unwrap();
    assert_eq!(d.name.as_deref(), Some("sim_42"));
    assert_eq!(d.queue.as_deref(), Some("cms"));
    assert_eq!(d.walltime, Some(7200));
    assert_eq!(d.slots, Some(4));
    assert!(d.resources.is_empty());
    assert_eq!(d.join, Some(Join::Oe));
    assert_eq!(d.stdout.as_deref(), Some("logs/out.txt"));
    assert_eq!(
        d.vars,
        vec![
            ("FOO".into(), given("bar")),
            ("HOME_DIR".into(), VarValue::FromEnvironment)
        ]
    );
    assert!(d.export_all);
    assert_eq!(d.workdir.as_deref(), Some("/scratch/u"));
    assert_eq!(d.shell.as_deref(), Some("/bin/bash"));
    assert_eq!(d.rerunnable, Some(false));
    assert_eq!(d.umask, Some(0o027));
    assert_eq!(d.group.as_deref(), Some("cms"));
    // nodes=1:ppn=4 is honoured now: no warning.
    assert!(d.warnings.is_empty(), "{:?}", d.warnings);
}

#[test]
fn scanning_stops_at_the_first_command() {
    let d = parse_script("#PBS -N first\necho hi\n#PBS -N second\n#PBS -x\n").unwrap();
    assert_eq!(d.name.as_deref(), Some("first"));
    assert_eq!(d.warnings.len(), 2);
    assert_eq!(d.warnings[0].line, Some(3));
}

#[test]
fn directives_before_the_shebang_and_indented_ones_count() {
    let d =
        parse_script("#PBS -q a\n#!/bin/sh\n  #PBS -N x\r\n\n#PBSX -N ignored\ntrue\n").unwrap();
    assert_eq!(d.queue.as_deref(), Some("a"));
    assert_eq!(d.name.as_deref(), Some("x"));
}

#[test]
fn options_are_tokenised_like_a_shell() {
    let d =
        parse_script("#PBS -o '/tmp/my out' -e \"/tmp/e \\\"q\\\"\" -Nname  # trailing comment\n")
            .unwrap();
    assert_eq!(d.stdout.as_deref(), Some("/tmp/my out"));
    assert_eq!(d.stderr.as_deref(), Some("/tmp/e \"q\""));
    assert_eq!(d.name.as_deref(), Some("name"));
    let d = parse_script("#PBS -Vj oe\n").unwrap();
    assert!(d.export_all);
    assert_eq!(d.join, Some(Join::Oe));
}

#[test]
fn errors_name_the_line_and_the_option() {
    let err = parse_script("#!/bin/sh\n#PBS -N ok\n#PBS -t 1-10\n").unwrap_err();
    assert_eq!(err.line(), Some(3));
    let PbsError::AtLine { source, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(**source, PbsError::UnknownOption { option: "t".into() });

    let err = parse_script("#PBS -N\n").unwrap_err();
    assert_eq!(err.line(), Some(1));
    assert!(matches!(
        *err_source(&err),
        PbsError::MissingValue { option: 'N' }
    ));

    let err = parse_script("\n#PBS -o 'open\n").unwrap_err();
    assert_eq!(err.line(), Some(2));
    assert!(matches!(
        *err_source(&err),
        PbsError::UnterminatedQuote { quote: '\'' }
    ));

    let err = parse_script("#PBS name\n").unwrap_err();
    assert!(matches!(
        *err_source(&err),
        PbsError::UnexpectedArgument { .. }
    ));

    for bad in [
        "#PBS -l walltime=1:99:00",
        "#PBS -j x",
        "#PBS -r maybe",
        "#PBS -q a.b",
        "#PBS -S bash",
        "#PBS -W umask=999",
        "#PBS -W umask=01000",
        "#PBS -W depend=afterok",
        "#PBS -W stagein=/a@h:/b",
        "#PBS -v 1BAD=x",
        "#PBS -N has/slash",
        "#PBS -W group_list=-x",
    ] {
        let err = parse_script(bad).expect_err(bad);
        assert_eq!(err.line(), Some(1), "{bad}");
    }
}

fn err_source(err: &PbsError) -> Box<PbsError> {
    match err {
        PbsError::AtLine { source, .. } => source.clone(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn ignored_options_warn() {
    let d = parse_script(
        "#PBS -m abe\n#PBS -M a@b.c\n#PBS -A proj\n#PBS -W x=1\n#PBS -q cms@server\n#PBS -o host:/x\n",
    )
    .unwrap();
    let lines: Vec<_> = d.warnings.iter().map(|w| w.line).collect();
    assert_eq!(
        lines,
        vec![Some(1), Some(2), Some(3), Some(4), Some(5), Some(6)]
    );
    assert_eq!(d.queue.as_deref(), Some("cms"));
    assert_eq!(d.stdout.as_deref(), Some("/x"));
}

#[test]
fn shell_and_group_lists_take_the_plain_entry() {
    assert_eq!(
        parse_shell_list("/bin/zsh@h1,/bin/bash").unwrap(),
        "/bin/bash"
    );
    assert_eq!(parse_shell_list("/bin/zsh@h1").unwrap(), "/bin/zsh");
    let d = parse_script("#PBS -W group_list=a@h,b,umask=7\n").unwrap();
    assert_eq!(d.group.as_deref(), Some("b"));
    assert_eq!(d.umask, Some(0o7));
}

#[test]
fn job_names_follow_the_rules() {
    assert!(validate_job_name("a-b_c.1+x").is_ok());
    assert!(validate_job_name(&"x".repeat(MAX_JOB_NAME_LEN)).is_ok());
    for bad in ["", "a b", "a\tb", "a/b", "-x", ".x", "é"] {
        assert!(validate_job_name(bad).is_err(), "{bad:?}");
    }
    assert!(validate_job_name(&"x".repeat(MAX_JOB_NAME_LEN + 1)).is_err());
    assert_eq!(sanitize_job_name("my job.sh"), "my_job.sh");
    assert_eq!(sanitize_job_name(".hidden"), "_hidden");
    assert_eq!(sanitize_job_name(""), "STDIN");
    assert!(validate_job_name(&sanitize_job_name(&"é ".repeat(300))).is_ok());
}

#[test]
fn the_command_line_wins_over_the_script() {
    let script = parse_script(
        "#PBS -N s\n#PBS -q a\n#PBS -v A=1,B=2\n#PBS -l walltime=10,mem=1gb\n#PBS -r n\n",
    )
    .unwrap();
    let mut cli = Directives::default();
    cli.apply_option('N', Some("c"), None).unwrap();
    cli.apply_option('v', Some("B=3"), None).unwrap();
    cli.apply_option('l', Some("walltime=20,mem=2gb"), None)
        .unwrap();
    cli.apply_option('V', None, None).unwrap();
    let d = script.overridden_by(cli);
    assert_eq!(d.name.as_deref(), Some("c"));
    assert_eq!(d.queue.as_deref(), Some("a"));
    assert_eq!(d.walltime, Some(20));
    assert_eq!(d.rerunnable, Some(false));
    assert!(d.export_all);
    assert_eq!(d.mem, Some(2 << 30));
    assert_eq!(
        d.vars,
        vec![
            ("A".into(), given("1")),
            ("B".into(), given("2")),
            ("B".into(), given("3"))
        ]
    );
}

#[test]
fn unknown_command_line_options_are_refused() {
    let mut d = Directives::default();
    assert!(matches!(
        d.apply_option('z', Some("x"), None),
        Err(PbsError::UnknownOption { .. })
    ));
    assert!(matches!(
        d.apply_option('q', None, None),
        Err(PbsError::MissingValue { option: 'q' })
    ));
}

#[test]
fn resource_requests_give_slots_and_memory() {
    let mut d = Directives::default();
    d.apply_option('l', Some("nodes=1:ppn=4"), None).unwrap();
    assert_eq!(d.slots, Some(4));
    assert!(d.warnings.is_empty(), "{:?}", d.warnings);
    let mut d = Directives::default();
    d.apply_option('l', Some("ncpus=3,mem=2gb"), None).unwrap();
    assert_eq!((d.slots, d.mem), (Some(3), Some(2 << 30)));
    let mut d = Directives::default();
    d.apply_option('l', Some("select=1:ncpus=2:mem=512mb"), None)
        .unwrap();
    assert_eq!((d.slots, d.mem), (Some(2), Some(512 << 20)));
    let mut d = Directives::default();
    d.apply_option('l', Some("select=ncpus=8"), None).unwrap();
    assert_eq!(d.slots, Some(8));
    let mut d = Directives::default();
    d.apply_option('l', Some("nodes=1"), None).unwrap();
    assert_eq!(d.slots, Some(1));
    let mut d = Directives::default();
    d.apply_option('l', Some("nodes=node07:ppn=2"), None)
        .unwrap();
    assert_eq!(d.slots, Some(2));
}

#[test]
fn multi_node_and_multi_chunk_requests_are_refused_with_a_reason() {
    for bad in [
        "nodes=2:ppn=4",
        "nodes=1:ppn=2+1:ppn=2",
        "select=2:ncpus=4",
        "select=1:ncpus=2+1:ncpus=2",
        "nodes=1:ppn=0",
        "ncpus=x",
        "ncpus=5000",
        "mem=12qb",
        "mem=0",
        "mem=gb",
    ] {
        let mut d = Directives::default();
        let e = d.apply_option('l', Some(bad), None).unwrap_err();
        assert!(matches!(e, PbsError::Resource { .. }), "{bad}: {e:?}");
        assert!(e.to_string().contains("invalid resource request"), "{e}");
    }
    let mut d = Directives::default();
    let e = d.apply_option('l', Some("nodes=2"), None).unwrap_err();
    assert!(e.to_string().contains("one VM"), "{e}");
}

#[test]
fn sizes_follow_torques_size_format() {
    for (bytes, text) in [
        (4u64 << 30, "4gb"),
        (1536, "1536b"),
        (3 << 20, "3mb"),
        (1 << 40, "1tb"),
        (2048, "2kb"),
        (7, "7b"),
    ] {
        assert_eq!(format_size(bytes), text);
        assert_eq!(parse_size(text), Ok(bytes), "{text} reads back");
    }
    assert_eq!(parse_size("100"), Ok(100));
    assert_eq!(parse_size("100b"), Ok(100));
    assert_eq!(parse_size("2kb"), Ok(2048));
    assert_eq!(parse_size("3MB"), Ok(3 << 20));
    assert_eq!(parse_size("4gb"), Ok(4 << 30));
    assert_eq!(parse_size("1tb"), Ok(1 << 40));
    assert_eq!(parse_size("10w"), Ok(80));
    assert_eq!(parse_size("1kw"), Ok(8192));
    assert_eq!(parse_size("1gw"), Ok(8 << 30));
    assert!(parse_size("").is_err());
    assert!(parse_size("1pb").is_err());
    assert!(parse_size("99999999999tb").is_err());
}

#[test]
fn a_command_line_slot_request_overrides_the_scripts() {
    let d = parse_script("#PBS -l nodes=1:ppn=4,mem=1gb\necho\n").unwrap();
    assert_eq!(d.slots, Some(4));
    let mut cli = Directives::default();
    cli.apply_option('l', Some("ncpus=2"), None).unwrap();
    let d = d.overridden_by(cli);
    assert_eq!((d.slots, d.mem), (Some(2), Some(1 << 30)));
}

#[test]
fn dependencies_parse_as_torque_writes_them() {
    use crate::messages::{DependKind, Dependency};
    let dep = |kind, jobs: &[&str]| Dependency {
        kind,
        jobs: jobs.iter().map(|j| j.to_string()).collect(),
    };
    assert_eq!(
        parse_depend("afterok:12").unwrap(),
        [dep(DependKind::AfterOk, &["12"])]
    );
    assert_eq!(
        parse_depend("afterok:1:2,afterany:3").unwrap(),
        [
            dep(DependKind::AfterOk, &["1", "2"]),
            dep(DependKind::AfterAny, &["3"])
        ]
    );
    assert_eq!(
        parse_depend("afternotok:a1.vq").unwrap(),
        [dep(DependKind::AfterNotOk, &["a1.vq"])]
    );
    assert_eq!(
        parse_depend("afterok:1:2,afterany:3").unwrap()[0].to_string(),
        "afterok:1:2"
    );
    // Repeats add nothing; the list is bounded.
    let many = format!("afterok{}", ":7".repeat(2000));
    assert_eq!(
        parse_depend(&many).unwrap(),
        [dep(DependKind::AfterOk, &["7"])]
    );
    let ids: String = (0..=super::MAX_DEPENDENCIES)
        .map(|i| format!(":{i}"))
        .collect();
    let err = parse_depend(&format!("afterany{ids}"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("1001 job ids (at most 1000"), "{err}");
    for (bad, says) in [
        ("afterok", "names no job"),
        ("afterok:", "empty job id"),
        ("afterok:1::2", "empty job id"),
        ("", "empty dependency list"),
        ("afterok:1,", "empty dependency"),
        ("before:1", "not supported by vq"),
        ("syncwith:1", "not supported by vq"),
        ("afterwards:1", "unknown dependency type"),
    ] {
        let err = parse_depend(bad).expect_err(bad).to_string();
        assert!(err.contains(says), "{bad:?}: {err}");
    }
    let long = format!("afterok:{}", "x".repeat(MAX_JOB_ID_BYTES + 1));
    assert!(parse_depend(&long).is_err());

    // In a script, next to other attributes, and accumulated.
    let d = parse_script(
        "#PBS -W depend=afterok:1:2,afterany:3,umask=022\n#PBS -W depend=afternotok:4\n",
    )
    .unwrap();
    assert_eq!(d.umask, Some(0o22));
    assert_eq!(
        d.depend,
        [
            dep(DependKind::AfterOk, &["1", "2"]),
            dep(DependKind::AfterAny, &["3"]),
            dep(DependKind::AfterNotOk, &["4"])
        ]
    );
    // The command line's dependencies replace the script's.
    let mut cli = Directives::default();
    cli.apply_option('W', Some("depend=afterany:9"), None)
        .unwrap();
    assert_eq!(
        d.clone().overridden_by(cli).depend,
        [dep(DependKind::AfterAny, &["9"])]
    );
    assert_eq!(
        d.clone().overridden_by(Directives::default()).depend.len(),
        3
    );
    let err = parse_script("#PBS -W depend=before:1\n").unwrap_err();
    assert_eq!(err.line(), Some(1));
}
