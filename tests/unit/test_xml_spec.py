"""Cuebot's XML job spec read into cuesched's JSON spec (opencue_api/xml_spec.py), per DTD version.

No database: the mapping and the refusals only. The spec the real pyoutline 1.37 sends is in
tests/integration/test_opencue_launch.py, which launches it end to end.
"""

from __future__ import annotations

import pytest

from opencue_api.xml_spec import VERSIONS, XmlSpecError, conform_job_name, read_spec


def doc(body: str, version: str = "1.15", head: str = "") -> str:
    return (
        f'<?xml version="1.0"?><!DOCTYPE spec PUBLIC "SPI Cue  Specification Language" '
        f'"http://localhost:8080/spcue/dtd/cjsl-{version}.dtd">{head}<spec>{body}</spec>'
    )


HEAD = "<show>demo</show><shot>sh-010</shot><user>alice</user><uid>1000</uid>"
LAYER = '<layer name="main" type="Render"><cmd>echo #IFRAME#</cmd><range>1-3</range><chunk>1</chunk>{}</layer>'


def job(layer_extra: str = "", job_extra: str = "", name: str = "hello") -> str:
    return f'<job name="{name}">{job_extra}<layers>{LAYER.format(layer_extra)}</layers></job>'


def refused(text: str, *words: str) -> str:
    with pytest.raises(XmlSpecError) as caught:
        read_spec(text)
    message = str(caught.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    return message


def test_a_full_1_15_spec_maps_every_field_onto_the_json_spec() -> None:
    layers = (
        '<layer name="Sim-A" type="Render"><cmd> sim -s #FRAME_START# </cmd><range>1-10</range><chunk>5</chunk>'
        "<cores>4.0</cores><threadable>True</threadable><memory>16G</memory><gpus>1</gpus>"
        "<gpu_memory>512m</gpu_memory><timeout>30</timeout><timeout_llu>10</timeout_llu>"
        "<tags>general | gpu</tags><limits><limit>arnold</limit><limit>arnold</limit></limits><env/>"
        "<services><service>shell</service><service>default</service></services><outputs/></layer>"
        '<layer name="movie" type="Util"><cmd>movie</cmd><range>1</range><chunk>1</chunk><cores>200</cores>'
        "<threadable>no</threadable><memory>2048</memory></layer>"
    )
    text = doc(
        "<facility>Local</facility><dept>lighting</dept>" + HEAD + "<email>alice@example.com</email>"
        '<job name="light_v1"><paused>False</paused><priority>100</priority><maxretries>2</maxretries>'
        "<maxcores>64</maxcores><maxgpus>4</maxgpus><autoeat>False</autoeat><os>linux</os><env/>"
        f"<layers>{layers}</layers></job>"
        '<depends><depend type="LAYER_ON_LAYER" anyframe="False"><depjob>light_v1</depjob><deplayer>movie</deplayer>'
        "<onjob>light_v1</onjob><onlayer>Sim-A</onlayer></depend></depends>"
    )
    plan = read_spec(text)
    assert (plan.user, plan.version) == ("alice", "1.15")
    assert plan.jobs == [
        {
            "show": "demo",
            "user": "alice",
            "shot": "sh_010",
            "uid": 1000,
            "facility": "local",
            "dept": "lighting",
            "email": "alice@example.com",
            "name": "demo-sh_010-alice_light_v1",
            "paused": False,
            "auto_eat": False,
            "priority": 100,
            "max_retries": 2,
            "max_cores": 64,
            "max_gpus": 4,
            "os": "linux",
            "layers": [
                {
                    "type": "Render",
                    "name": "sim_a",
                    "command": "sim -s #FRAME_START#",
                    "range": "1-10",
                    "chunk_size": 5,
                    "cores": 4,
                    "threadable": True,
                    "memory": "16GB",
                    "gpus": 1,
                    "gpu_memory": "512MB",
                    "timeout": 30,
                    "timeout_llu": 10,
                    "tags": ["general", "gpu"],
                    "limits": ["arnold"],
                    "services": ["shell", "default"],
                },
                {
                    "type": "Util",
                    "name": "movie",
                    "command": "movie",
                    "range": "1",
                    "chunk_size": 1,
                    "cores": 2,  # core points without a dot: 200 is 2 cores, as Cuebot reads it
                    "threadable": False,
                    "memory": "2048GB",  # a bare number is GB in Cuebot
                    "depends": [{"layer": "sim_a", "type": "layer"}],
                },
            ],
        }
    ]


def test_a_frame_by_frame_depend_within_the_job_maps_to_a_frame_dependency() -> None:
    layers = LAYER.format("").replace('"main"', '"sim"') + LAYER.format("").replace('"main"', '"render"')
    text = doc(
        HEAD + f'<job name="fbf"><layers>{layers}</layers></job><depends><depend type="FRAME_BY_FRAME">'
        "<depjob>demo-sh_010-alice_fbf</depjob><deplayer>render</deplayer><onjob>fbf</onjob><onlayer>sim</onlayer>"
        "</depend></depends>"
    )
    (spec,) = read_spec(text).jobs
    assert spec["layers"][1]["depends"] == [{"layer": "sim", "type": "frame"}]
    assert "depends" not in spec["layers"][0]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_smallest_spec_of_every_version_reads_the_same(version: str) -> None:
    (spec,) = read_spec(doc(HEAD + job(), version)).jobs
    assert spec["name"] == "demo-sh_010-alice_hello"
    assert spec["layers"] == [
        {"type": "Render", "name": "main", "command": "echo #IFRAME#", "range": "1-3", "chunk_size": 1}
    ]


@pytest.mark.parametrize(
    ("version", "where", "element", "since"),
    [
        ("1.5", "job", "<os>linux</os>", "1.6"),
        ("1.6", "layer", "<gpu>1g</gpu>", "1.7"),
        ("1.7", "job", '<localbook host="h" cores="1" memory="1" threads="1" gpu="0"/>', "1.8"),
        ("1.9", "layer", "<timeout>5</timeout>", "1.10"),
        ("1.9", "layer", "<timeout_llu>5</timeout_llu>", "1.10"),
        ("1.10", "job", "<priority>5</priority>", "1.11"),
        ("1.11", "layer", "<gpus>1</gpus>", "1.12"),
        ("1.11", "layer", "<gpu_memory>1g</gpu_memory>", "1.12"),
        ("1.12", "job", "<maxcores>4</maxcores>", "1.13"),
        ("1.12", "job", "<maxgpus>4</maxgpus>", "1.13"),
        ("1.13", "layer", "<outputs/>", "1.14"),
    ],
)
def test_an_element_from_a_later_version_is_refused_naming_the_version(
    version: str, where: str, element: str, since: str
) -> None:
    body = job(layer_extra=element) if where == "layer" else job(job_extra=element)
    tag = element[1:].split(">")[0].split()[0].rstrip("/")
    refused(doc(HEAD + body, version), f"<{tag}> arrived in cjsl {since}", f"this spec is cjsl {version}")
    # ... and read from the version that brought it (localbook is refused for its own reason).
    if tag != "localbook":
        read_spec(doc(HEAD + body, since))


def test_uid_is_required_before_1_9_and_optional_from_it() -> None:
    no_uid = "<show>demo</show><shot>sh010</shot><user>alice</user>"
    refused(doc(no_uid + job(), "1.8"), "<uid> is required")
    (spec,) = read_spec(doc(no_uid + job(), "1.9")).jobs
    assert "uid" not in spec


def test_gpu_memory_wins_over_the_deprecated_gpu() -> None:
    (spec,) = read_spec(doc(HEAD + job("<gpus>2</gpus><gpu>2g</gpu><gpu_memory>4g</gpu_memory>"))).jobs
    assert (spec["layers"][0]["gpus"], spec["layers"][0]["gpu_memory"]) == (2, "4GB")
    (spec,) = read_spec(doc(HEAD + job("<gpu>3g</gpu>"), "1.7")).jobs
    assert spec["layers"][0]["gpu_memory"] == "3GB"


@pytest.mark.parametrize(
    ("layer_extra", "job_extra", "words"),
    [
        ("<cores>four</cores>", "", ["<cores>", "'four' is not a number of cores"]),
        ("<cores>1.5</cores>", "", ["<cores>", "1.5 cores: cuesched books whole cores"]),
        ("<cores>4</cores>", "", ["<cores>", "4 core points"]),
        ("<cores>5000.0</cores>", "", ["<cores>", "500000 core points"]),
        ("<threadable>maybe</threadable>", "", ["<threadable>", "'maybe' is not true or false"]),
        ("<memory>lots</memory>", "", ["<memory>", "'lots' is not a memory size"]),
        ("<memory>4k</memory>", "", ["<memory>", "not a memory size"]),
        ("<gpus>one</gpus>", "", ["<gpus>", "'one' is not a whole number"]),
        ("<tags>general | x!</tags>", "", ["<tags>", "'x!' is not a tag"]),
        ("<gpu_memory>x</gpu_memory>", "", ["<gpu_memory>", "not a memory size"]),
        ("<timeout>1h</timeout>", "", ["<timeout>", "'1h' is not a whole number"]),
        ("<timeout_llu>-1</timeout_llu>", "", ["<timeout_llu>", "must be 0 or more"]),
        ("", "<paused>perhaps</paused>", ["<paused>", "not true or false"]),
        ("", "<priority>high</priority>", ["<priority>", "'high' is not a whole number"]),
        ("", "<maxretries>2.5</maxretries>", ["<maxretries>", "not a whole number"]),
        ("", "<maxcores>many</maxcores>", ["<maxcores>", "not a whole number"]),
        ("", "<maxgpus>x</maxgpus>", ["<maxgpus>", "not a whole number"]),
        ("", "<autoeat>sometimes</autoeat>", ["<autoeat>", "not true or false"]),
    ],
)
def test_a_wrong_type_in_any_field_is_refused_naming_the_field(
    layer_extra: str, job_extra: str, words: list[str]
) -> None:
    refused(doc(HEAD + job(layer_extra, job_extra)), *words)


def test_a_wrong_chunk_uid_or_name_is_refused() -> None:
    refused(doc(HEAD + job().replace("<chunk>1</chunk>", "<chunk>0</chunk>")), "<chunk>", "must be 1 or more")
    refused(doc(HEAD + job().replace("<chunk>1</chunk>", "<chunk>x</chunk>")), "<chunk>", "not a whole number")
    refused(doc(HEAD.replace("1000", "abc") + job()), "<uid>", "'abc' is not a whole number")
    refused(doc(HEAD + job(name="ab")), "job name 'ab'")
    refused(doc(HEAD + job().replace('name="main"', 'name="a b"')), "layer name 'a b'")
    refused(doc(HEAD + job().replace('type="Render"', 'type="Comp"')), "type 'Comp' is not Render, Util or Post")


def test_autoeat_is_the_json_spec_auto_eat_in_every_version() -> None:
    """Refused until auto-eat was served (issue 30); now Cuebot's reading: Convert.stringToBool."""
    for version in VERSIONS:
        (spec,) = read_spec(doc(HEAD + job(job_extra="<autoeat>True</autoeat>"), version=version)).jobs
        assert spec["auto_eat"] is True, version
    (spec,) = read_spec(doc(HEAD + job(job_extra="<autoeat> yes </autoeat>"))).jobs
    assert spec["auto_eat"] is True
    (spec,) = read_spec(doc(HEAD + job(job_extra="<autoeat>false</autoeat>"))).jobs
    assert spec["auto_eat"] is False
    (spec,) = read_spec(doc(HEAD + job())).jobs
    assert "auto_eat" not in spec  # not given: the JSON spec's default (off)


def test_what_cuesched_cannot_do_yet_is_refused_not_dropped() -> None:
    refused(doc(HEAD + job(job_extra='<localbook host="h" cores="1" memory="1" threads="1" gpu="0"/>')), "<localbook>")
    refused(doc(HEAD + job('<outputs><output name="beauty">/out/x.exr</output></outputs>')), "<outputs>")
    refused(doc(HEAD + job().replace('type="Render"', 'type="Post"')), "type Post")
    refused(doc(HEAD.replace("alice", "root") + job()), "cannot launch jobs as root")
    refused(doc(HEAD.replace("1000", "0") + job()), "cannot launch jobs as root")


def test_env_at_job_and_layer_level_maps_onto_the_json_specs_env() -> None:
    text = doc(
        HEAD
        + job(
            '<env><key name="OCIO"> /show/a.ocio </key><key name="SHARED">layer</key></env>',
            '<env><key name="JOB_ONLY">1</key><key name="SHARED">job</key><key name="EMPTY"/></env>',
        )
    )
    (spec,) = read_spec(text).jobs
    assert spec["env"] == {"JOB_ONLY": "1", "SHARED": "job", "EMPTY": ""}
    assert spec["layers"][0]["env"] == {"OCIO": "/show/a.ocio", "SHARED": "layer"}  # trimmed, as Cuebot's
    # An empty <env> (pyoutline always writes one) sets nothing.
    (plain,) = read_spec(doc(HEAD + job("<env/>", "<env/>"))).jobs
    assert "env" not in plain and "env" not in plain["layers"][0]


def test_env_names_are_left_to_the_json_spec_and_a_key_given_twice_or_unnamed_is_refused() -> None:
    # The JSON spec's check (dispatch/jobs/spec.py) decides a name's form: the XML passes it on.
    (spec,) = read_spec(doc(HEAD + job('<env><key name="1-BAD">x</key></env>'))).jobs
    assert spec["layers"][0]["env"] == {"1-BAD": "x"}
    refused(
        doc(HEAD + job(job_extra='<env><key name="A">1</key></env><env><key name="A">2</key></env>')),
        "job 'hello'",
        "<env> sets 'A' more than once",
    )
    refused(doc(HEAD + job("<env><key>1</key></env>")), "layer main <env>", "<key> needs the attribute 'name'")
    refused(doc(HEAD + job("<env><value>1</value></env>")), "<value> is not in <env>")


TWO_LAYERS = LAYER.format("").replace('"main"', '"sim"') + LAYER.format("").replace('"main"', '"render"')


def two_jobs(depends: str) -> str:
    """Job `comp` (layers sim and render) and job `light` (layer main), then the depends."""
    return doc(
        HEAD
        + f'<job name="comp"><layers>{TWO_LAYERS}</layers></job>'
        + job(name="light")
        + f"<depends>{depends}</depends>"
    )


def dep(kind: str, depjob: str = "comp", onjob: str = "light", deplayer: str = "", onlayer: str = "") -> str:
    tags = f"<depjob>{depjob}</depjob>"
    tags += f"<deplayer>{deplayer}</deplayer>" if deplayer else ""
    tags += f"<onjob>{onjob}</onjob>"
    tags += f"<onlayer>{onlayer}</onlayer>" if onlayer else ""
    return f'<depend type="{kind}" anyframe="False">{tags}</depend>'


LIGHT = "demo-sh_010-alice_light"


@pytest.mark.parametrize(
    ("depend", "sim", "render"),
    [
        # A job-level depend (no <deplayer>): every layer of the depending job waits.
        (dep("JOB_ON_JOB"), [{"job": LIGHT, "type": "job"}], [{"job": LIGHT, "type": "job"}]),
        (
            dep("JOB_ON_LAYER", onlayer="Main"),
            [{"job": LIGHT, "layer": "main", "type": "layer"}],
            [{"job": LIGHT, "layer": "main", "type": "layer"}],
        ),
        (dep("LAYER_ON_JOB", deplayer="render"), None, [{"job": LIGHT, "type": "job"}]),
        (
            dep("LAYER_ON_LAYER", deplayer="render", onlayer="main"),
            None,
            [{"job": LIGHT, "layer": "main", "type": "layer"}],
        ),
        (
            dep("frame_by_frame", deplayer="sim", onlayer="main"),
            [{"job": LIGHT, "layer": "main", "type": "frame"}],
            None,
        ),
        # Within one job: no "job" key (the JSON spec's own-job form).
        (
            dep("LAYER_ON_LAYER", onjob="comp", deplayer="render", onlayer="sim"),
            None,
            [{"layer": "sim", "type": "layer"}],
        ),
        # The job's full name, as Cuebot's conformJobName takes it, and the same wait twice is one.
        (
            dep("JOB_ON_JOB", onjob=LIGHT) + dep("LAYER_ON_JOB", deplayer="sim"),
            [{"job": LIGHT, "type": "job"}],
            [{"job": LIGHT, "type": "job"}],
        ),
    ],
)
def test_every_depend_type_the_json_spec_has_maps_onto_the_depending_layers(
    depend: str, sim: list[dict[str, str]] | None, render: list[dict[str, str]] | None
) -> None:
    comp, light = read_spec(two_jobs(depend)).jobs
    layers = {layer["name"]: layer for layer in comp["layers"]}
    assert layers["sim"].get("depends") == sim
    assert layers["render"].get("depends") == render
    assert "depends" not in light["layers"][0]


def test_a_depend_on_a_job_already_launched_names_it_for_the_submit_to_find() -> None:
    # Not a job of the spec: the JSON spec's submit looks it up (an unknown one is its error).
    (spec,) = read_spec(
        doc(HEAD + job() + f"<depends>{dep('LAYER_ON_LAYER', 'hello', 'fx_v2', 'main', 'sim')}</depends>")
    ).jobs
    assert spec["layers"][0]["depends"] == [{"job": "demo-sh_010-alice_fx_v2", "layer": "sim", "type": "layer"}]


@pytest.mark.parametrize(
    ("depend", "words"),
    [
        (dep("JOB_ON_JOB", onjob="comp"), ["JOB_ON_JOB", "would wait for itself"]),
        (dep("LAYER_ON_JOB", onjob="comp", deplayer="sim"), ["would wait for itself"]),
        (dep("JOB_ON_LAYER", onjob="comp", onlayer="sim"), ["would wait for its own layer 'sim'"]),
        (dep("JOB_ON_JOB", deplayer="sim"), ["<deplayer>: a JOB_ON_JOB depend is of or on the whole job", "LAYER_ON_"]),
        (dep("LAYER_ON_JOB", deplayer="sim", onlayer="main"), ["<onlayer>: a LAYER_ON_JOB depend"]),
        (dep("LAYER_ON_LAYER", onlayer="main"), ["<deplayer> is required: a LAYER_ON_LAYER depend names the layer"]),
        (dep("FRAME_BY_FRAME", deplayer="sim"), ["<onlayer> is required"]),
        (dep("JOB_ON_JOB", depjob="fx_v2"), ["job 'demo-sh_010-alice_fx_v2' is not a job of this spec"]),
        (dep("LAYER_ON_JOB", deplayer="nope"), ["job 'demo-sh_010-alice_comp' has no layer 'nope'"]),
        (
            dep("LAYER_ON_LAYER", deplayer="sim", onlayer="main").replace("False", "True"),
            ["LAYER_ON_LAYER", "anyframe true"],
        ),
        (dep("JOB_ON_JOB").replace("False", "True"), ["anyframe true"]),
        (dep("JOB_ON_JOB", onjob="a b"), ["<onjob>", "'a b' is not a job name"]),
    ]
    + [
        (dep(kind, deplayer="sim", onlayer="main"), [kind, "no dependency of or on single frames", "JOB_ON_JOB"])
        for kind in (
            "JOB_ON_FRAME",
            "LAYER_ON_FRAME",
            "FRAME_ON_JOB",
            "FRAME_ON_LAYER",
            "FRAME_ON_FRAME",
            "PREVIOUS_FRAME",
            "LAYER_ON_SIM_FRAME",
        )
    ]
    + [
        (
            dep("LAYER_ON_LAYER", deplayer="sim", onlayer="main").replace("</onjob>", "</onjob><onframe>1</onframe>"),
            ["<onframe>: a LAYER_ON_LAYER depend is not between frames"],
        ),
        (
            '<depend type="SIDEWAYS"><depjob>comp</depjob><onjob>light</onjob></depend>',
            ["type 'SIDEWAYS' is not one of"],
        ),
        ('<depend type="LAYER_ON_LAYER"><deplayer>sim</deplayer></depend>', ["<depjob> is required"]),
    ],
)
def test_a_depend_the_json_spec_cannot_say_is_refused_naming_the_depend(depend: str, words: list[str]) -> None:
    message = refused(two_jobs(depend), *words)
    assert message.startswith("depend 1 ("), message


def test_a_depend_on_a_layer_maps_even_when_the_onlayer_is_unknown_so_the_submit_names_it() -> None:
    # The JSON spec's check reports the unknown layer with the job's other errors.
    text = doc(HEAD + job() + f"<depends>{dep('LAYER_ON_LAYER', 'hello', 'hello', 'main', 'ghost')}</depends>")
    (spec,) = read_spec(text).jobs
    assert spec["layers"][0]["depends"] == [{"layer": "ghost", "type": "layer"}]


ENTITY_BOMB = (
    '<?xml version="1.0"?><!DOCTYPE spec [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">'
    '<!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;"><!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;">]>'
    "<spec><show>&d;</show></spec>"
)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (ENTITY_BOMB, ["internal subset"]),
        (
            '<?xml version="1.0"?><!DOCTYPE spec SYSTEM "file:///etc/passwd"><spec><show>&x;</show></spec>',
            ["refers to the entity 'x'", "entities are refused"],
        ),
        (doc(HEAD.replace("demo", "&x;") + job()), ["refers to the entity 'x'"]),
        (
            '<?xml version="1.0"?><spec><show>&x;</show></spec>',
            ["not well-formed", "undefined entity"],
        ),
        (
            '<?xml version="1.0"?><!DOCTYPE spec SYSTEM "http://localhost:8080/spcue/dtd/cjsl-1.15.dtd">'
            "<spec><show>demo</show>",
            ["not well-formed", "no element found"],
        ),
        ("<spec><show>demo</show></spec>", ["no <!DOCTYPE spec"]),
        (doc(HEAD + job(), "1.16"), ["version 1.16", "1.5 to 1.15"]),
        (doc(HEAD + job(), "1.4"), ["version 1.4"]),
        (doc(HEAD + job()).replace("<spec>", "<job>").replace("</spec>", "</job>"), ["root element is <job>"]),
        ("not xml at all", ["not well-formed"]),
        ("", ["not well-formed"]),
        (doc(HEAD), ["has no <job>"]),
        (doc(HEAD + job() + job()), ["is given twice"]),
        (doc(HEAD + "<colour>red</colour>" + job()), ["<colour> is not in <spec> in the DTD"]),
        (doc(HEAD + job().replace("<job ", '<job nice="1" ')), ["unknown attribute 'nice' of <job>"]),
        (doc("<show>demo</show><user>alice</user><uid>1</uid>" + job()), ["<shot> is required"]),
        (doc(HEAD + job("<memory>1g</memory><memory>2g</memory>")), ["<memory> is given 2 times"]),
        (doc(HEAD + job("<cores><x/></cores>")), ["<cores> holds text, not <x>"]),
    ],
)
def test_unsafe_and_malformed_documents_are_refused(text: str, words: list[str]) -> None:
    refused(text, *words)


def test_an_internal_entity_is_refused_even_without_a_subset_marker_check() -> None:
    """The entity handler refuses a declaration even if the DOCTYPE check were bypassed (a
    parameter entity, an external DTD): nothing is ever expanded."""
    text = '<?xml version="1.0"?><!DOCTYPE spec [<!ENTITY e SYSTEM "file:///etc/passwd">]><spec>&e;</spec>'
    refused(text, "internal subset")


def test_a_document_too_large_or_too_deep_is_refused() -> None:
    refused(doc(HEAD + job(), "1.15") + " " * (16 * 1024 * 1024), "more than")
    deep = "<cmd>" * 40 + "x" + "</cmd>" * 40
    refused(
        doc(HEAD + f'<job name="deep"><layers><layer name="main" type="Render">{deep}</layer></layers></job>'), "deeper"
    )


def test_conform_job_name_is_cuebots() -> None:
    assert conform_job_name("demo", "sh010", "alice", "Light-V1") == "demo-sh010-alice_light_v1"
    # a name already carrying the prefix is not prefixed twice
    assert conform_job_name("demo", "sh010", "alice", "demo-sh010-alice_light") == "demo-sh010-alice_light"
    assert conform_job_name("demo", "sh010", "alice", "a__b") == "demo-sh010-alice_a_b"
    assert conform_job_name("demo", "sh010", "alice", "ab") is None
