"""One time format in the console: 24 h, ISO date, the zone named (the request's zone, see
ops.timezone_middleware); Django's en default mixed "9:04 p.m." with ISO and UTC times."""

DATETIME_FORMAT = "Y-m-d H:i:s T"
SHORT_DATETIME_FORMAT = "Y-m-d H:i T"
TIME_FORMAT = "H:i:s"
DATE_FORMAT = "Y-m-d"
SHORT_DATE_FORMAT = "Y-m-d"
